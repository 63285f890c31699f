"""forge's adapter of Monarch's SlurmJob, without a cluster: which class is used, its options,
its batch script, and its workers' ports (forge.controller.slurm.job)."""

from pathlib import Path

import pytest
from monarch.config import configure, get_global_config
from monarch.job import SlurmJob

from forge.controller.jobs import HostsConfig, make_job
from forge.controller.slurm import job as slurm_job
from forge.controller.slurm.job import ForgeSlurmJob, adapter_needed, make_slurm_job, worker_ports


def test_the_adapter_is_for_monarch_0_7_only() -> None:
    """A later Monarch (which may fix its SlurmJob) gets its own class back."""
    assert adapter_needed("0.7.0")
    assert not adapter_needed("0.8.0")


def test_a_later_monarch_gets_its_own_slurm_job_with_the_log_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(slurm_job, "adapter_needed", lambda: False)
    previous = get_global_config()["default_transport"]
    try:
        job = make_slurm_job(2, "hosts", tmp_path / "jobs", {"partition": "debug"})
    finally:
        configure(default_transport=previous)  # Monarch's SlurmJob switches the process to TCP
    assert type(job) is SlurmJob and job._log_dir == str((tmp_path / "jobs").resolve())


def test_making_forges_slurm_job_leaves_the_process_transport_alone(tmp_path: Path) -> None:
    """Other meshes of the process (tests, this host's roles) keep their transport until attach."""
    before = repr(get_global_config()["default_transport"])
    ForgeSlurmJob({"hosts": 2}, log_dir=str(tmp_path))
    assert repr(get_global_config()["default_transport"]) == before


def test_slurm_needs_a_log_folder_and_it_is_never_the_current_one(tmp_path: Path) -> None:
    """The apps pass <output_dir>/jobs; hosts.options.log_dir wins; without either it is an error."""
    cfg = HostsConfig(job="slurm", num_hosts=2, options={"partition": "debug"})
    with pytest.raises(ValueError, match="needs a folder for the job's logs"):
        make_job(cfg)
    assert make_job(cfg, tmp_path / "jobs")._log_dir == str(tmp_path / "jobs")
    mine = HostsConfig(job="slurm", options={"log_dir": str(tmp_path / "mine")})
    assert make_job(mine, tmp_path / "jobs")._log_dir == str(tmp_path / "mine")


def test_an_unknown_option_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"hosts.options: .*'partitoin'"):
        make_slurm_job(1, "hosts", tmp_path, {"partitoin": "debug"})


def test_a_controller_outside_the_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hosts.options.out_of_cluster is not supported"):
        ForgeSlurmJob({"hosts": 1}, log_dir=str(tmp_path), out_of_cluster=True)


def test_the_batch_script_starts_one_worker_step_per_node(tmp_path: Path) -> None:
    """--no-kill (a lost node is a lost host), logs under log_dir, the options as directives."""
    job = ForgeSlurmJob(
        {"hosts": 2}, log_dir=str(tmp_path), partition="debug", time_limit="00:30:00", slurm_args=["--hold"]
    )
    job._ensure_service_proc_ids(2)
    script = job.batch_script(2)
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --no-kill",
        "#SBATCH --partition=debug",
        "#SBATCH --time=00:30:00",
        "#SBATCH --hold",
        f"#SBATCH --output={tmp_path}/slurm_%j.out",
        "export MONARCH_SERVICE_PROC_IDS=",
        "srun --nodes=1 --ntasks=1",
        "-m forge.controller.slurm.worker",
    ]:
        assert line in script, f"{line!r} missing from:\n{script}"
    assert "--account" not in script


@pytest.mark.parametrize(
    ("addresses", "ports"),
    [
        (["10.0.0.7", "10.0.0.8"], [22222, 22222]),  # one node a machine: one port
        (["127.0.0.1", "127.0.0.1"], [22222, 22223]),  # two nodes on one machine
        (["a", "b", "a", "a"], [22222, 22222, 22223, 22224]),
    ],
)
def test_nodes_sharing_a_machine_get_ports_of_their_own(addresses: list[str], ports: list[int]) -> None:
    assert worker_ports(addresses, 22222) == ports


def test_the_controller_listens_on_the_route_to_the_workers() -> None:
    assert slurm_job.controller_ip("service@tcp://127.0.0.1:22222") == "127.0.0.1"


def test_a_slurm_pool_names_its_hosts_by_node_and_worker() -> None:
    """Messages about a host name the Slurm node and its worker; the pool's other names still work."""
    from forge.controller.hosts import HostPool, NotEnoughHosts
    from tests.unit.controller.test_hosts_spanning import _FakeHostMesh

    pool = HostPool(_FakeHostMesh(2))
    pool.addresses, pool.node_names = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], ["n1", "n2"]
    assert pool.describe(1) == "n2 (tcp://127.0.0.1:2)"
    assert pool.names() == ["n1 (tcp://127.0.0.1:1)", "n2 (tcp://127.0.0.1:2)"]
    with pytest.raises(NotEnoughHosts, match=r"only 2 host\(s\) \(\['n1 \(tcp"):
        pool.check_count(3)
