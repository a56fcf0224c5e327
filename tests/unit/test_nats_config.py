"""The ``nats`` config section: what each field turns into for nats-py, and clear errors (naming the
field) for inconsistent settings and missing secrets. Secrets come from files and environment
variables made here; none is ever in a config file."""

from __future__ import annotations

import ssl
import subprocess

import pytest

from thunderagent.bus.connect import connect_options
from thunderagent.config import ConfigError, parse_config
from thunderagent.overrides import build_config


def nats_cfg(**section: object):
    return parse_config({"nats": section}, "test").nats


def test_default_is_one_open_local_server():
    cfg = parse_config({}, "test").nats
    assert cfg.servers == ["nats://127.0.0.1:4222"] and connect_options(cfg) == {}


@pytest.mark.parametrize(("section", "message"), [
    ({"servers": []}, "at least one server"),
    ({"servers": ["http://x:4222"]}, "nats://HOST:PORT or tls://HOST:PORT"),
    ({"servers": ["nats://u:p@x:4222"]}, "carries credentials"),
    ({"servers": ["nats://a:4222", "tls://b:4222"]}, "mix of nats:// and tls://"),
    ({"tls": {"cert_file": "c.pem"}}, "cert_file and key_file go together"),
    ({"auth": {}}, "exactly one auth method"),
    ({"auth": {"user": "u"}}, "user (or user_env) and password_file"),
    ({"auth": {"password_env": "P"}}, "user (or user_env) and password_file"),
    ({"auth": {"user": "u", "password_env": "P", "token_env": "T"}}, "exactly one auth method"),
    ({"auth": {"token_file": "t", "token_env": "T"}}, "give token_file or token_env, not both"),
    ({"auth": {"password": "inline"}}, "nats.auth.password"),  # no inline secrets: unknown field
    ({"index": "hybrid"}, "'replica' or 'sharded'"),
    ({"lookup_timeout_s": 0.1}, "lookup_timeout_s acts only with index: sharded"),
    ({"index": "sharded", "lookup_timeout_s": 0}, "greater than 0"),
])
def test_inconsistent_settings_are_refused_naming_the_field(section, message):
    with pytest.raises(ConfigError) as err:
        nats_cfg(**section)
    assert message in str(err.value) and "field 'nats" in str(err.value)


def test_user_and_password_from_env_token_from_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TA_TEST_USER", "worker-w0")
    monkeypatch.setenv("TA_TEST_PASS", "s3cret\n")
    opts = connect_options(nats_cfg(auth={"user_env": "TA_TEST_USER", "password_env": "TA_TEST_PASS"}))
    assert opts == {"user": "worker-w0", "password": "s3cret"}
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    assert connect_options(nats_cfg(auth={"token_file": str(token)})) == {"token": "tok-123"}


def test_missing_secrets_name_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("TA_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"nats.auth.password_env: environment variable TA_TEST_UNSET is not set"):
        connect_options(nats_cfg(auth={"user": "u", "password_env": "TA_TEST_UNSET"}))
    with pytest.raises(ConfigError, match=r"nats.auth.token_file: cannot read"):
        connect_options(nats_cfg(auth={"token_file": str(tmp_path / "nope")}))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"nats.auth.token_file: .* is empty"):
        connect_options(nats_cfg(auth={"token_file": str(tmp_path / "empty")}))
    with pytest.raises(ConfigError, match=r"nats.tls.ca_file: cannot read"):
        connect_options(nats_cfg(tls={"ca_file": str(tmp_path / "ca.pem")}))


def test_nkey_and_creds_are_passed_as_files(tmp_path, monkeypatch):
    pytest.importorskip("nkeys")
    seed = tmp_path / "w0.nk"
    seed.write_text("SUAEXAMPLE")
    assert connect_options(nats_cfg(auth={"nkey_seed_file": str(seed)})) == {"nkeys_seed": str(seed)}
    monkeypatch.setenv("TA_TEST_SEED", "SUAEXAMPLE")
    assert connect_options(nats_cfg(auth={"nkey_seed_env": "TA_TEST_SEED"})) == {"nkeys_seed_str": "SUAEXAMPLE"}
    creds = tmp_path / "w0.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----")
    assert connect_options(nats_cfg(auth={"creds_file": str(creds)})) == {"user_credentials": str(creds)}


def test_tls_urls_or_section_give_a_verifying_context(tmp_path):
    opts = connect_options(nats_cfg(servers=["tls://a:4222", "tls://b:4222"]))
    assert isinstance(opts["tls"], ssl.SSLContext) and opts["tls"].verify_mode == ssl.CERT_REQUIRED
    ca = tmp_path / "ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(tmp_path / "ca.key"), "-out", str(ca), "-days", "1", "-subj", "/CN=test ca"],
                   check=True, capture_output=True)
    opts = connect_options(nats_cfg(tls={"ca_file": str(ca), "hostname": "nats.internal"}))
    assert opts["tls"].check_hostname and opts["tls_hostname"] == "nats.internal"
    assert opts["tls"].get_ca_certs()[0]["subject"] == ((("commonName", "test ca"),),)


def test_nats_flag_overrides_the_servers_of_the_file(tmp_path):
    cfg_file = tmp_path / "deploy.yaml"
    cfg_file.write_text("nats: {servers: ['nats://10.0.0.1:4222']}\n")
    assert build_config(cfg_file).nats.servers == ["nats://10.0.0.1:4222"]
    cfg = build_config(cfg_file, nats_servers="tls://a:4222, tls://b:4222")
    assert cfg.nats.servers == ["tls://a:4222", "tls://b:4222"]


@pytest.mark.parametrize("command", ["worker", "frontend"])
def test_cli_refuses_a_missing_secret_before_connecting(tmp_path, monkeypatch, command):
    from typer.testing import CliRunner

    from thunderagent.cli import app

    monkeypatch.delenv("TA_TEST_UNSET", raising=False)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text("nats: {auth: {user: w0, password_env: TA_TEST_UNSET}}\n")
    result = CliRunner().invoke(app, [command, "--config", str(cfg)])
    assert result.exit_code == 2
    assert "nats.auth.password_env: environment variable TA_TEST_UNSET is not set" in result.output


def test_serve_refuses_a_sharded_index(tmp_path):
    from typer.testing import CliRunner

    from thunderagent.cli import app

    cfg = tmp_path / "one.yaml"
    cfg.write_text("nats: {index: sharded}\n")
    result = CliRunner().invoke(app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "nats.index: sharded splits the index between `thunderagent frontend` replicas" in result.output
