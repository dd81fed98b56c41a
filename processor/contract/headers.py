"""Every Kafka header name ksow reads or writes, in one place (see the contract's "Headers")."""

# Input headers (all optional).
COMMAND = "sow-command"  # publish | delta_publish | sow_delete
EXPIRATION = "sow-expiration"  # this record's lifetime; 0 = never
KEY = "sow-key"  # publisher-supplied SowKey (input) / the SowKey (output)
FILTER = "sow-filter"  # sow_delete by filter
KEYS = "sow-keys"  # sow_delete by SowKeys, comma-separated
KNOWN_INPUT = frozenset({COMMAND, EXPIRATION, KEY, FILTER, KEYS})

# Output headers on .sow, .diff, EXP.*, .dead and views.
OP = "sow-op"  # insert | update | delete | expire | evict | oof
SEQ = "sow-seq"  # event ID
EXPIRES_AT = "sow-expires-at"  # epoch ms (absent: never)
ACTUAL_EXPIRY = "sow-actual-expiry"  # epoch ms the record was expired
OOF_REASON = "sow-oof-reason"  # on view oof events
# On expiry and dead event topics only: the SOW topic the record left. Several SOW topics may share
# one such topic (as Artemis queues share an expiry address, whose messages say their origin).
TOPIC = "sow-topic"

# On `<topic>.errors`.
ERROR = "sow-error"  # why the input could not be applied
ERROR_TOPIC = "sow-error-topic"
ERROR_PARTITION = "sow-error-partition"
ERROR_OFFSET = "sow-error-offset"

# Every `sow-` header ksow reads or writes. An input may carry any of them (a `.sow` or `.errors`
# record published again), but another `sow-` name is a misspelt one (`Sow-Command`, `sow-expires`):
# it would be ignored, and the input applied as it was not meant.
KNOWN = KNOWN_INPUT | {OP, SEQ, EXPIRES_AT, ACTUAL_EXPIRY, OOF_REASON, TOPIC, ERROR, ERROR_TOPIC, ERROR_PARTITION, ERROR_OFFSET}

# Internal, on `<topic>.repartition` only.
ORIGIN = "ksow-origin"  # the command a rerouted input defaulted to on its first topic
LOCAL = "ksow-local"  # a fanned-out delete applies to this partition only
SOURCE = "ksow-source"  # where a rerouted input was first: b"topic:partition:offset" (its `.errors` record says so)
SOURCE_KEY = "ksow-source-key"  # its Kafka key there (absent: it had none)
INTERNAL = frozenset({ORIGIN, LOCAL, SOURCE, SOURCE_KEY})
