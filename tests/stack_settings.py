"""Settings shared by the e2e stack fixtures and the tests that rely on them."""

#: Short vLLM timeouts for the fault tests, so a registration that never
#: matches and a lease that runs out end within seconds, not minutes.
FAULT_REGISTRATION_TIMEOUT_S = 15
FAULT_KV_LEASE_S = 20
