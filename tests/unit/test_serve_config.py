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
        ("policy.adapters_per_replica=-1", "policy.adapters_per_replica must be >= 0"),
    ],
)
def test_bad_server_settings_name_the_setting(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(ServeConfig, "configs/serve_tiny.yaml", [override])


def test_adapters_are_refused_when_they_clash_with_the_base_or_the_engine_mode():
    with pytest.raises(ValueError, match="policy.adapters.tiny: the base model is served as 'tiny'"):
        load_config(ServeConfig, "configs/serve_tiny.yaml", ["server.model_name=tiny", "policy.adapters.tiny=/a"])
    with pytest.raises(ValueError, match="policy.adapters needs policy.engine_mode 'batched', got 'async'"):
        load_config(ServeConfig, "configs/serve_tiny.yaml", ["policy.engine_mode=async", "policy.adapters.a=/a"])


def test_adapter_folders_that_are_not_peft_loras_or_differ_in_shape_are_refused_naming_them(tmp_path):
    from apps.serve.main import read_adapters
    from forge.models.lora import LoraSettings, write_adapter_folder

    with pytest.raises(ValueError, match="is not a PEFT adapter folder: it has no adapter_config.json or"):
        read_adapters({"a": str(tmp_path)})
    import torch

    tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(4, 8)}
    for name, rank in (("a", 4), ("b", 8)):
        write_adapter_folder(tmp_path / name, tensors, LoraSettings(rank=rank), "base")
    assert read_adapters({"a": str(tmp_path / "a")})["a"][0].rank == 4
    with pytest.raises(ValueError, match="must share one rank, alpha and target modules; got a: r=4.*b: r=8"):
        read_adapters({"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})
