"""engine-serve's command-line defaults and the checks of its options that need no server code.

Kept apart from the server's modules (starlette, pydantic, jinja2) because engine-serve reads
them before it starts the engine cores: everything imported before the cores are spawned
delays the whole start by its import time.
"""

from __future__ import annotations

from collections.abc import Sequence

# Large enough for a full 128k-token context sent as token ids (~7 bytes each in JSON) or an
# lm-eval batch of a few hundred scoring prompts; small enough that parsing it is quick.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def check_cors(allowed_origins: Sequence[str], allow_credentials: bool) -> None:
    """Refuse any origin (``*``) together with credentials. Starlette would answer such a
    request by echoing the caller's own origin with ``Access-Control-Allow-Credentials``, so
    every web page a user of the API visits could call it with that user's cookies or
    client certificate: the same-origin protection browsers give is gone."""
    if allow_credentials and "*" in allowed_origins:
        raise ValueError(
            "--allowed-origins '*' cannot be combined with --allow-credentials: any web site could "
            "then make requests carrying your users' credentials. List the origins that may call "
            "with credentials (--allowed-origins https://app.example.com), or drop --allow-credentials"
        )


def open_without_key_warning(host: str, api_key: str | None) -> str | None:
    """The warning engine-serve logs when it listens beyond this machine with no API key (None
    when it does not): anyone who reaches the port can use the model and its GPU. A loopback
    address (127.0.0.0/8, ::1, localhost) is private to the machine; anything else, all
    interfaces (0.0.0.0, ::) above all, is not."""
    if api_key:
        return None
    import ipaddress

    name = host.strip().strip("[]")
    if name == "localhost":
        return None
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any interface
    where = "all interfaces" if name in ("", "0.0.0.0", "::") else "an address other machines may reach"
    return (
        f"serving on {host or '0.0.0.0'} ({where}) WITHOUT an API key: anyone who can reach the port can use "
        "this model and its compute. Pass --api-key (or set PAGECAST_API_KEY), or --host 127.0.0.1"
    )
