"""The job's state and nodes are read by its id from both squeue --json schemas, replayed from
fixtures that list other users' jobs too (forge.controller.slurm.queue)."""

import json
from pathlib import Path

import pytest

from forge.controller.slurm.queue import addresses_from_scontrol, job_from_json, job_from_line

FIXTURES = Path(__file__).parent / "fixtures"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_22_05_the_running_job_is_found_by_its_id_not_first_in_the_list() -> None:
    """22.05 lists every job, another user's COMPLETED one first: forge reads its own job."""
    data = _load("squeue_22.05.json")
    assert data["jobs"][0]["job_state"] == "COMPLETED"  # what Monarch 0.7 took
    info = job_from_json(data, "2")
    assert (info.job_id, info.state, info.reason, info.nodes) == ("2", "RUNNING", "", ["n1", "n2"])
    assert info.running and not info.ended


def test_22_05_a_pending_job_has_its_reason_and_no_nodes() -> None:
    """A pending job (no job_resources, nodes "") reports the scheduler's reason."""
    data = _load("squeue_22.05.json")
    held = job_from_json(data, 4)
    assert (held.state, held.reason, held.nodes) == ("PENDING", "JobHeldUser", [])
    assert held.describe() == "PENDING (reason: JobHeldUser)"
    assert job_from_json(data, 3).reason == "PartitionNodeLimit"


def test_22_05_another_users_ended_job_reads_as_ended() -> None:
    """COMPLETED is a terminal state."""
    info = job_from_json(_load("squeue_22.05.json"), 1)
    assert info.ended and info.nodes == ["n1"]


def test_24_05_the_job_is_found_by_its_id_with_its_allocation() -> None:
    """The newer schema: a state list, the nodes from the hostlist string or the allocation."""
    data = _load("squeue_24.05.json")
    info = job_from_json(data, 815)
    assert (info.state, info.reason, info.nodes) == ("RUNNING", "", ["gpu03", "gpu04"])
    del data["jobs"][2]["nodes"]  # the allocation list alone names them too
    assert job_from_json(data, 815).nodes == ["gpu03", "gpu04"]


def test_24_05_pending_and_held_jobs_have_their_reasons() -> None:
    data = _load("squeue_24.05.json")
    assert job_from_json(data, 816).describe() == "PENDING (reason: PartitionNodeLimit)"
    assert job_from_json(data, 817).reason == "JobHeldUser"
    assert job_from_json(data, 811).ended


def test_state_flags_after_the_base_state_are_kept_apart() -> None:
    """["RUNNING", "COMPLETING"]: the base state is RUNNING, the flag is kept."""
    data = _load("squeue_24.05.json")
    data["jobs"][2]["job_state"] = ["RUNNING", "COMPLETING"]
    info = job_from_json(data, 815)
    assert info.state == "RUNNING" and info.flags == ("COMPLETING",)


@pytest.mark.parametrize("fixture", ["squeue_22.05.json", "squeue_24.05.json"])
def test_a_job_not_listed_is_none(fixture: str) -> None:
    """A job the controller no longer lists (or never had) is None, never another job."""
    assert job_from_json(_load(fixture), 999) is None


@pytest.mark.parametrize("fixture", ["squeue_22.05.json", "squeue_24.05.json"])
def test_the_monarch_shape_is_what_monarch_0_7_reads(fixture: str) -> None:
    """as_monarch() gives job_state as a list and job_resources.nodes.allocation[].name."""
    data = _load(fixture)
    running = [j for j in data["jobs"] if "RUNNING" in str(j["job_state"]) and j["user_name"] in ("root", "carol")]
    info = job_from_json(data, running[0]["job_id"])
    shaped = info.as_monarch()
    assert "RUNNING" in shaped["job_state"]
    assert [n["name"] for n in shaped["job_resources"]["nodes"]["allocation"]] == info.nodes


def test_output_that_is_not_squeue_json_is_an_error_naming_the_job() -> None:
    with pytest.raises(ValueError, match="job 5 has no 'jobs' list"):
        job_from_json({"meta": {}}, 5)
    with pytest.raises(ValueError, match="job 5 has no readable job_state"):
        job_from_json({"jobs": [{"job_id": 5}]}, 5)


def test_the_plain_format_is_read_by_id() -> None:
    """The fallback ``squeue -h -o '%i|%T|%r|%N'`` lines."""
    out = "3|PENDING|PartitionNodeLimit|\n12|RUNNING|None|n[1-2]\n"
    assert job_from_line(out, 12).nodes == ["n1", "n2"]
    assert job_from_line(out, "3").describe() == "PENDING (reason: PartitionNodeLimit)"
    assert job_from_line(out, 4) is None


def test_node_addresses_come_from_scontrol() -> None:
    """NodeName -> NodeAddr from ``scontrol -o show node`` (22.05's output, shortened)."""
    out = (
        "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=vm Port=17001 State=IDLE\n"
        "NodeName=n2 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.8 NodeHostName=node2 Port=17002 State=IDLE\n"
    )
    assert addresses_from_scontrol(out) == {"n1": "127.0.0.1", "n2": "10.0.0.8"}
