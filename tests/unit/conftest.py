from hypothesis import HealthCheck, settings

# The machine is shared and loaded: judge properties by their results, not by wall-clock deadlines.
settings.register_profile("ksow", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ksow")
