"""Short-lived JWTs for the SDK's `pjwt_auth_enabled` flow (`POST /api/v1/auth/token`).

With `jwt_auth` on, the SDK exchanges its `tml-` key once for a JWT and then sends the JWT in
`X-API-Key` (refreshing it at half its lifetime). The token is HS256 over the gateway's
`signing_secret`, which every replica shares (configured, or the random one the first replica
stored in KV `tinker_gateway`), so a token minted by one replica is accepted by all; should the
secret change, the SDK, told `invalid_token`, simply exchanges its key again. API keys are
accepted beside JWTs either way.

Claims: `sub` (the principal's URN), `org_id` (the tenant), `email` (empty: keys are not users),
`kid` (the key's digest prefix), `iat`, `exp`. `RestClient.whoami` reads `sub` and `org_id`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

from services.gateway.accounts.auth import Tenant
from services.gateway.http.errors import Unauthorized

ISSUER = "tinkerd"
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
"""RFC 6750: the SDK replaces a token rejected with this header and replays the request once."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def user_urn(tenant: Tenant) -> str:
    return f"tml:org-user:{tenant.id}:{tenant.key_digest[:16]}"


def looks_like_jwt(credential: str | None) -> bool:
    return bool(credential) and credential.startswith("eyJ") and credential.count(".") == 2  # type: ignore[union-attr]


def mint(tenant: Tenant, secret: bytes, lifetime_s: float, now: float | None = None) -> str:
    issued = int(now if now is not None else time.time())
    header = {"alg": "HS256", "typ": "JWT"}
    claims = {
        "iss": ISSUER,
        "sub": user_urn(tenant),
        "org_id": tenant.id,
        "email": "",
        "kid": tenant.key_digest[:16],
        "name": tenant.key_name,
        "iat": issued,
        "exp": issued + max(1, int(lifetime_s)),
    }
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    sig = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(sig)}"


def verify(token: str, secret: bytes, now: float | None = None) -> Tenant:
    """The tenant a valid, unexpired token of ours names; 401 `invalid_token` otherwise."""
    try:
        header_b64, claims_b64, sig_b64 = token.split(".")
        expected = hmac.new(secret, f"{header_b64}.{claims_b64}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, _unb64(sig_b64)):
            raise Unauthorized("the JWT's signature is not this server's; exchange the API key again", INVALID_TOKEN)
        header, claims = json.loads(_unb64(header_b64)), json.loads(_unb64(claims_b64))
    except (ValueError, UnicodeDecodeError):
        raise Unauthorized("malformed JWT in X-API-Key", INVALID_TOKEN) from None
    if header.get("alg") != "HS256" or claims.get("iss") != ISSUER:
        raise Unauthorized("the JWT was not issued by this server", INVALID_TOKEN)
    if float(claims.get("exp", 0)) <= (now if now is not None else time.time()):
        raise Unauthorized("the JWT has expired; exchange the API key again", INVALID_TOKEN)
    org, kid = str(claims.get("org_id", "")), str(claims.get("kid", ""))
    if not org:
        raise Unauthorized("the JWT names no tenant", INVALID_TOKEN)
    return Tenant(id=org, key_digest=kid, key_name=str(claims.get("name", "")))
