"""Metric sinks: the JSONL record, the console line, the optional TensorBoard, make_sinks."""

import json
import logging
import sys

import pytest

from forge.observability import ConsoleSink, JsonlSink, MetricSink, TensorBoardSink, make_sinks
from forge.observability import sinks as sinks_module


def test_jsonl_sink_writes_one_object_per_step_and_flushes_each_step(tmp_path):
    """Each log() is a line {"step": n, ...} readable before the sink is closed."""
    sink = JsonlSink(tmp_path / "run")
    sink.log(0, {"loss": 1.5, "reward_mean": 0.1})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "loss": 1.5, "reward_mean": 0.1}]
    sink.log(1, {"loss": 1.0})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def test_jsonl_sink_writes_non_finite_values_as_null(tmp_path):
    """NaN/inf become null so the file stays strict JSON."""
    sink = JsonlSink(tmp_path)
    sink.log(3, {"loss": float("nan"), "grad_norm": float("inf")})
    sink.close()
    assert json.loads(sink.path.read_text()) == {"step": 3, "loss": None, "grad_norm": None}


def test_jsonl_sink_refuses_to_log_after_close(tmp_path):
    """A closed sink says so instead of failing on a closed file."""
    sink = JsonlSink(tmp_path)
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.log(0, {"x": 1.0})


def test_jsonl_sink_resumed_after_a_step_keeps_earlier_rows_and_appends(tmp_path):
    """Rows past the resume step and a line cut short by a kill are dropped; new rows append."""
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo'
    )
    sink = JsonlSink(tmp_path, resume_after=2)
    sink.log(3, {"loss": 30.0})
    sink.close()
    rows = [json.loads(line) for line in sink.path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_console_sink_logs_one_compact_line_per_step(caplog):
    """'step 12 | loss 0.1235 | reward_mean 0.5' through the forge.metrics logger."""
    with caplog.at_level(logging.INFO, logger="forge.metrics"):
        ConsoleSink().log(12, {"reward_mean": 0.5, "loss": 0.123456})
    assert [r.getMessage() for r in caplog.records] == ["step 12 | loss 0.1235 | reward_mean 0.5"]


def test_tensorboard_sink_without_tensorboard_warns_once_and_does_nothing(tmp_path, monkeypatch, caplog):
    """Missing TensorBoard: one warning for any number of sinks, and log() is a no-op."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setattr(sinks_module, "_tensorboard_warned", False)
    with caplog.at_level(logging.WARNING, logger=sinks_module.__name__):
        first, second = TensorBoardSink(tmp_path), TensorBoardSink(tmp_path)
        first.log(0, {"loss": 1.0})
        first.close()
    assert not first.enabled and not second.enabled
    assert len([r for r in caplog.records if "TensorBoardSink disabled" in r.getMessage()]) == 1
    assert not (tmp_path / "tensorboard").exists()


def test_make_sinks_builds_named_sinks_in_order(tmp_path, monkeypatch):
    """['console', 'jsonl', 'tensorboard'] gives those sinks, all satisfying MetricSink."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    sinks = make_sinks(["console", "jsonl", "tensorboard"], tmp_path)
    assert [type(s) for s in sinks] == [ConsoleSink, JsonlSink, TensorBoardSink]
    assert all(isinstance(s, MetricSink) for s in sinks)
    for s in sinks:
        s.log(0, {"loss": 1.0})
        s.close()
    assert (tmp_path / "metrics.jsonl").exists()


def test_make_sinks_rejects_unknown_names_listing_known_ones(tmp_path):
    """'mlflow' is not a sink: the error lists console, jsonl, tensorboard, wandb."""
    with pytest.raises(ValueError, match=r"'mlflow'.*\['console', 'jsonl', 'tensorboard', 'wandb'\]"):
        make_sinks(["console", "mlflow"], tmp_path)


def test_tensorboard_charts_eval_figures_at_the_step_whose_weights_they_describe(tmp_path):
    """An eval/* value logged in step 12's row with eval/step 10 is an event at step 10."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    sink.log(12, {"loss": 0.5, "eval/accuracy": 0.25, "eval/step": 10.0})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(10, 0.25)]
    assert [e.step for e in events.Scalars("loss")] == [12]


def test_wandb_runs_offline_unless_configured(tmp_path, monkeypatch):
    """No key, no login, no WANDB_MODE: offline; an API key or a netrc login: online; a bad mode is named."""
    from forge.observability.sinks import wandb_mode

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled" and wandb_mode("offline") == "offline"
    with pytest.raises(ValueError, match="wandb mode must be online, offline or disabled"):
        wandb_mode("cloud")


def test_wandb_sink_writes_an_offline_run_with_the_config_and_every_figure(tmp_path, monkeypatch):
    """Offline, the run is written under <output_dir>/wandb: its record file holds the config and
    each step's figures, eval ones included; closing the sink stops W&B's service process."""
    from forge.observability import WandbSink

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink(tmp_path, project="forge-test", name="t", config={"trainer": {"lr_of_the_run": 0.001}})
    assert sink.mode == "offline"
    sink.log(1, {"loss": 2.0})
    sink.log(2, {"loss": 1.5, "eval/accuracy": 0.25, "eval/step": 2.0})
    sink.close()
    (record,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    written = record.read_bytes()  # W&B's own record format: protobuf, keys and JSON values as bytes
    for needle in (b"lr_of_the_run", b"0.001", b"eval/accuracy", b"0.25", b"eval/step", b"loss", b"1.5"):
        assert needle in written, needle
    assert (tmp_path / "wandb_run_id").read_text().strip()
