"""What an experiment tracker may see of a run's config: everything but credentials.

The resolved config goes to MLflow (params, the config.toml artifact) and W&B (its config),
services often shared more widely than the run's own folder. Before it does:

- a field whose name ends with a word that names a credential (its last `_`-, `.`- or
  `-`-separated word is key, token, secret, password, passwd, credential(s), auth, apikey,
  signature or sig, or the word before a last `file` or `path` is: `api_key`, `hf_token`,
  `fault_tolerance.secret_file`, but not `data.token_dtype` or `data.tokenizer`) has its value
  replaced by `***`. In distrain's schema that is `fault_tolerance.secret_file` alone;
- in every text value, a URL's user information (`scheme://user:pass@host`, up to the last `@`
  before the path) becomes `scheme://***@host`, and a query or fragment parameter whose name
  ends with such a word (`?token=...`, `&X-Amz-Credential=...`, `&sig=...`, `#access_token=...`)
  keeps its name and loses its value.

The run's own config.toml keeps the real values: a resume needs them.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
SECRET_WORDS = frozenset(
    {
        "key",
        "token",
        "secret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "auth",
        "apikey",
        "signature",
        "sig",
    }
)
# User information runs to the authority's last `@` (a password may hold an unescaped one).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/\s?#]+@")
_QUERY = re.compile(r"(?P<lead>[?&;#])(?P<name>[^=&;#\s]+)=(?P<value>[^&;#\s]*)")


def secret_name(name: str) -> bool:
    """`name` (a field or query parameter) names a credential, or a file holding one."""
    words = re.split(r"[._\-]", name.lower())
    if len(words) > 1 and words[-1] in ("file", "path"):
        words.pop()
    return words[-1] in SECRET_WORDS


def redact_text(text: str) -> str:
    """`text` without URL user information or secret-named query values."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)

    def query(m: re.Match[str]) -> str:
        if not secret_name(m["name"]):
            return m[0]
        return f"{m['lead']}{m['name']}={REDACTED}"

    return _QUERY.sub(query, text)


def redacted(value: Any, name: str = "") -> Any:
    """`value` (a config as `Config.to_dict` gives it: dicts, lists, scalars) with credentials
    replaced; `name` is the field it is the value of."""
    if isinstance(value, dict):
        return {key: redacted(item, str(key)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(item, name) for item in value]
    if name and secret_name(name) and value not in ("", None):
        return REDACTED
    return redact_text(value) if isinstance(value, str) else value
