"""What a tracker may see of a config (observe/redact.py): the rule against distrain's real
schema (which fields are redacted by name, and that none is redacted for merely containing a
credential word's letters), URL user information and secret-named query values in any text
field, and the flattened params the trackers get."""

from __future__ import annotations

import pytest

from distrain.config.io import load_config
from distrain.config.schema import Config
from distrain.observe.redact import REDACTED, redact_text, redacted, secret_name
from distrain.observe.trackers import flat_params


def _fields(node: dict, prefix: str = "") -> list[str]:
    """Every field name under `node`, a list of tables (data.sources) as `name[]`."""
    names = []
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            names += _fields(value, name)
        elif value and isinstance(value, list) and isinstance(value[0], dict):
            names += _fields(value[0], f"{name}[]")
        else:
            names.append(name)
    return names


def test_the_schemas_fields_redacted_by_name_are_exactly_the_documented_ones(tmp_path):
    """docs/guides/monitoring.md names them: a field added to the schema with a credential name
    changes this list, and the guide with it."""
    toml = tmp_path / "config.toml"
    toml.write_text(
        "[[data.sources]]\npath = 'a'\n[[data.sources]]\npath = 'b'\n"
        "[[data.eval_sets]]\nname = 'e'\npath = 'c'\n"
    )
    names = _fields(load_config(toml).to_dict())
    assert {"data.sources[].weight", "data.eval_sets[].glob"} <= set(names)
    assert [n for n in names if secret_name(n.rsplit(".", 1)[-1])] == [
        "fault_tolerance.secret_file"
    ]
    for lookalike in ("token_dtype", "tokenizer", "keep_temporary", "max_skew", "author"):
        assert not secret_name(lookalike), lookalike


@pytest.mark.parametrize(
    "name",
    ["api_key", "hf_token", "secret", "password", "db-passwd", "aws.credentials", "auth",
     "apikey", "X-Amz-Signature", "sig", "secret_file", "token_path", "X-Amz-Security-Token"],
)  # fmt: skip
def test_credential_names(name):
    assert secret_name(name)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://alice:pw@mlflow.example:5000", "http://***@mlflow.example:5000"),
        ("https://alice:p@ss@host/x", "https://***@host/x"),  # an unescaped @ in the password
        ("postgresql://u:pw@db/runs", "postgresql://***@db/runs"),
        ("https://h/d?sv=2024&sig=AbC%2F&se=1", "https://h/d?sv=2024&sig=***&se=1"),
        ("https://h/o?X-Amz-Credential=AK%2F1&X-Amz-Signature=ff&X-Amz-Expires=60",
         "https://h/o?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
        ("https://h/cb#access_token=tok&state=3", "https://h/cb#access_token=***&state=3"),
        ("s3://bucket/run/checkpoints", "s3://bucket/run/checkpoints"),
        ("http://h/a@b?page=2", "http://h/a@b?page=2"),  # an @ in the path is no user info
        ("runs/my@run", "runs/my@run"),
    ],
)  # fmt: skip
def test_text_loses_user_info_and_secret_query_values(text, shown):
    assert redact_text(text) == shown


def test_a_config_reaches_the_trackers_without_its_credentials(tmp_path):
    secrets = ("pw-in-uri", "SIG-IN-SOURCE", "TOKEN-IN-INIT", "/keys/GROUP-SECRET")
    toml = tmp_path / "config.toml"
    toml.write_text(
        "[data]\ncache_dir = 'cache'\n"
        "[[data.sources]]\npath = 's3://b/x?X-Amz-Signature=SIG-IN-SOURCE'\n"
        "[[data.sources]]\npath = 'https://u:pw-in-uri@h/y'\n"
    )
    cfg = load_config(
        toml,
        [
            ("metrics.mlflow.tracking_uri", "http://alice:pw-in-uri@mlflow.example:5000"),
            ("model.init_from", "https://h/model?token=TOKEN-IN-INIT"),
            ("fault_tolerance.secret_file", "/keys/GROUP-SECRET"),
        ],
    )
    params = flat_params(cfg.to_dict())
    assert not [v for v in params.values() if any(s in v for s in secrets)]
    assert params["fault_tolerance.secret_file"] == REDACTED
    assert params["metrics.mlflow.tracking_uri"] == "http://***@mlflow.example:5000"
    assert params["model.init_from"] == "https://h/model?token=***"
    assert "s3://b/x?X-Amz-Signature=***" in params["data.sources"]
    assert "https://***@h/y" in params["data.sources"]
    assert params["data.token_dtype"] == "uint16" and params["data.tokenizer"] == "bytes"
    # Nothing else changes, and an unset secret stays visibly unset.
    plain = Config().to_dict()
    assert redacted(plain) == plain and plain["fault_tolerance"]["secret_file"] == ""
