"""Who the caller is and what their tenant may hold: API keys and tenants (`auth`), short-lived
JWTs (`jwt_auth`), per-tenant limits (`quotas`), and sessions that end or expire
(`session_lifecycle`)."""
