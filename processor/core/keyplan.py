"""The SowKeys a filter names: a filter whose equality terms cover every key field of a topic can
only match the records of the SowKeys its literals make, so a store reads those, not all its
records (queries and deletes by filter), and a delete goes only to the partitions that own them."""

from __future__ import annotations

import itertools
import math

from processor.contract.limits import MAX_INDEX_LOOKUPS
from processor.core.filters import key_texts_equal_to
from processor.core.keys import KeySpec, checksum_key


def choose_keys(predicate, keys: KeySpec | None, plain_spelling: bool) -> list[str] | None:
    """The SowKeys a filter can match when its equality terms (`literal_terms`) name every key
    field, as AMPS answers from the hash index it keeps over the SowKey's fields: a few point reads
    instead of a scan. None when they do not, past MAX_INDEX_LOOKUPS combinations, or when a number
    or boolean literal names a key field of a store that may hold odd spellings of it
    (`key_texts_equal_to`; `plain_spelling`: the store holds none, `PartitionStore.plain_key_spelling`;
    False gives the SowKeys that hold in every partition)."""
    if keys is None or not keys.paths:
        return None
    terms = predicate.literal_terms()
    texts: list[list[str]] = []
    for path in keys.paths:
        literals = terms.get(path)
        if literals is None:
            return None
        found: set[str] = set()
        for literal in literals:
            equal, whole_if_plain = key_texts_equal_to(literal)
            if whole_if_plain and not plain_spelling:
                return None
            found |= equal
        texts.append(sorted(found))
    if math.prod(len(t) for t in texts) > MAX_INDEX_LOOKUPS:
        return None
    return [checksum_key(keys.domain, list(combo)) for combo in itertools.product(*texts)]
