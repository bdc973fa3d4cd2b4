"""Who the caller is and what their tenant may hold: API keys and tenants (`auth`), short-lived
JWTs (`jwt_auth`), per-tenant limits (`quotas`), sessions that end or expire
(`session_lifecycle`), and the audit entry each change records (`audit`)."""
