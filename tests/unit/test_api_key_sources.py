"""API-key configuration and the tenant salt: every source parses, every mistake names its field,
and no client salt of one tenant can produce another tenant's salt. Keys are generated per run."""

from __future__ import annotations

import secrets

import pytest

from thunderagent.config import ConfigError, parse_config
from thunderagent.frontend.auth import KeyRing, load_keyring, tenant_salt
from thunderagent.kv.hashing import hash_seed

K1, K2, ADMIN = (secrets.token_urlsafe(24) for _ in range(3))


def _cp(**fields: object):
    return parse_config({"control_plane": fields}, "t.yaml").control_plane


def test_keys_off_by_default():
    cp = _cp()
    assert not cp.keys_on and load_keyring(cp) is None


@pytest.mark.parametrize(("fields", "needle"), [
    ({"api_keys": {"short": "acme"}}, "at least 16 characters"),
    ({"api_keys": {K1: "bad:name"}}, "must be 1-64 characters"),
    ({"api_keys": {K1 + " x": "acme"}}, "printable ASCII"),
    ({"api_keys": {K1: "acme"}, "admin_keys": ["short"]}, "at least 16 characters"),
    ({"admin_keys": [ADMIN]}, "acts only with API keys on"),
    ({"admin_keys_env": "X"}, "acts only with API keys on"),
])
def test_bad_inline_keys_name_the_field(fields, needle):
    with pytest.raises(ConfigError) as exc:
        _cp(**fields)
    assert "field 'control_plane" in str(exc.value) and needle in str(exc.value)
    assert K1 not in str(exc.value)  # a key never appears in an error


def test_file_of_lines_yaml_mapping_and_env(tmp_path, monkeypatch):
    lines = tmp_path / "keys.txt"
    lines.write_text(f"# comment\n\n{K1} acme   # trailing comment\n")
    mapping = tmp_path / "keys.yaml"
    mapping.write_text(f"{K2}: globex\n")
    admins = tmp_path / "admins.txt"
    admins.write_text(f"{ADMIN}\n")
    monkeypatch.setenv("TA_UNIT_KEYS", f"{K2} globex\n")
    for fields in ({"api_keys_file": str(lines), "api_keys_env": "TA_UNIT_KEYS"},
                   {"api_keys_file": str(mapping), "api_keys": {K1: "acme"}}):
        ring = load_keyring(_cp(**fields, admin_keys_file=str(admins)))
        assert ring is not None
        assert ring.tenant(K1) == "acme" and ring.tenant(K2) == "globex"
        assert ring.is_admin(ADMIN) and not ring.is_admin(K1) and ring.tenant(ADMIN) is None


@pytest.mark.parametrize(("content", "env", "field", "needle"), [
    (None, None, "api_keys_file", "cannot read"),
    ("", None, "api_keys_file", "holds no key"),
    (f"{K1} acme extra\n", None, "api_keys_file", "line 1 must be `KEY TENANT`"),
    (f"{K1}: 'a b'\n", None, "api_keys_file", "must be 1-64 characters"),
    (f"{K1}: acme\n", f"{K1}: globex", "api_keys_env", "one key is given to two tenants"),
])
def test_bad_key_sources_name_the_field(tmp_path, monkeypatch, content, env, field, needle):
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    fields: dict[str, object] = {"api_keys_file": str(path)}
    if env is not None:
        monkeypatch.setenv("TA_UNIT_KEYS", env)
        fields["api_keys_env"] = "TA_UNIT_KEYS"
    with pytest.raises(ConfigError) as exc:
        load_keyring(_cp(**fields))
    assert f"field 'control_plane.{field}'" in str(exc.value) and needle in str(exc.value)
    assert K1 not in str(exc.value)


def test_unset_environment_variable_is_an_error(monkeypatch):
    monkeypatch.delenv("TA_UNIT_UNSET", raising=False)
    with pytest.raises(ConfigError, match="field 'control_plane.api_keys_env': environment variable TA_UNIT_UNSET"):
        load_keyring(_cp(api_keys_env="TA_UNIT_UNSET"))


def test_tenant_salt_isolates_tenants_and_subdivides_within_one():
    assert tenant_salt(None, None) is None and tenant_salt(None, "s") == "s"  # keys off: as the client sent
    assert tenant_salt("acme", None) == "tenant:acme"
    assert tenant_salt("acme", "team-1") == "tenant:acme:team-1"
    # whatever salt a client of acme picks, it never lands on globex's salt (no ':' in tenant names)
    for client in (None, "", "globex", "tenant:globex", ":globex", "x:tenant:globex"):
        assert tenant_salt("acme", client) not in (tenant_salt("globex", None), tenant_salt("globex", "s"))
    seeds = {hash_seed(tenant_salt(t, c)) for t in ("acme", "globex") for c in (None, "s")}
    assert len(seeds) == 4  # and the router's hash chains differ accordingly


def test_keyring_looks_keys_up_by_digest():
    ring = KeyRing({K1: "acme"}, [ADMIN])
    assert ring.tenant(K1) == "acme" and ring.tenant(K1[:-1]) is None and ring.tenant("") is None
    assert K1 not in repr(vars(ring))  # only digests are held
