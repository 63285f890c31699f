"""The serve app's settings: a server reachable from other machines needs an API key."""

import pytest

from apps.serve.config import ServeConfig, is_loopback
from forge.config import load_config


def test_only_loopback_addresses_count_as_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.2", "::", "example.com"))


def test_binding_beyond_loopback_without_an_api_key_is_refused_naming_the_host():
    with pytest.raises(ValueError, match=r"server.host '0.0.0.0' is not a loopback address: set server.api_key"):
        load_config(ServeConfig, "configs/serve_tiny.yaml", ["server.host=0.0.0.0"])
    cfg = load_config(ServeConfig, "configs/serve_tiny.yaml", ["server.host=0.0.0.0", "server.api_key=k"])
    assert cfg.server.api_key == "k"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.port=70000", "server.port must be an int in 0..65535, got 70000"),
        ("server.max_concurrent=0", "server.max_concurrent must be >= 1, got 0"),
        ("server.request_timeout_s=0", "server.request_timeout_s must be > 0"),
        ("server.api_key=''", "server.api_key is empty"),
        ("server.router=nearest", "server.router: unknown router 'nearest'; expected one of"),
    ],
)
def test_bad_server_settings_name_the_setting(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(ServeConfig, "configs/serve_tiny.yaml", [override])
