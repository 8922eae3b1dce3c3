"""Stale torch build locks (offload_study.admission.ops): a build killed mid-way leaves ``<op>/lock``, and
every later load of that op would wait for it forever; a lock whose build still runs stays.

The locks are made by torch's own FileBaton (what torch.utils.cpp_extension takes around a
build) in processes that are killed or keep running, in a TORCH_EXTENSIONS_DIR of the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runs import load_record, make_run, run_runner
from torch.utils.file_baton import FileBaton

from offload_study.admission import ops, preflight

#: The extensions root this test run found (the machine's builds, made by make's step), read
#: before any test points TORCH_EXTENSIONS_DIR at its own folder
MACHINE_EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR")
OP = "deepspeed_shm_comm"  # the smallest op (~1 MB built): cheap to copy, quickest to rebuild

#: Takes the build lock of the folder argv[1] as torch's build does, says so, then stays until
#: it is killed (with the lock open) or, with a second argument, works there as ninja does.
HOLDER = """
import os, sys, time
from torch.utils.file_baton import FileBaton
if len(sys.argv) > 2:
    os.chdir(sys.argv[1])
else:
    assert FileBaton(os.path.join(sys.argv[1], "lock")).try_acquire()
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    """An empty torch extensions root with the op's build folder (where its lock goes)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "ext" / OP).mkdir(parents=True)
    return tmp_path / "ext"


def start_holder(folder: Path, *how: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), *how], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "holding"
    return proc


def killed_build(folder: Path) -> None:
    """The lock a build killed mid-way leaves: taken by FileBaton, never released."""
    holder = start_holder(folder)
    holder.kill()
    holder.wait()
    assert (folder / "lock").exists()


def test_the_lock_of_a_killed_build_is_removed(extensions):
    killed_build(extensions / OP)
    assert ops.build_dir(OP) == extensions / OP
    assert "no process on this host" in ops.stale_lock_reason(extensions / OP)
    assert ops.remove_stale_lock(OP) == extensions / OP / "lock"
    # torch's build first tries to take the baton: it now builds instead of waiting forever
    assert FileBaton(str(extensions / OP / "lock")).try_acquire()


@pytest.mark.parametrize("how", [(), ("works-there",)], ids=["holds-the-lock", "ninja-running"])
def test_the_lock_of_a_running_build_stays(extensions, how):
    lock = extensions / OP / "lock"
    if how:  # the lock's Python process is gone, but its ninja still compiles in the folder
        killed_build(extensions / OP)
    holder = start_holder(extensions / OP, *how)
    try:
        assert ops.builds_in(extensions / OP) == [holder.pid]
        assert ops.stale_lock_reason(extensions / OP) is None
        assert ops.remove_stale_lock(OP) is None and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert ops.remove_stale_lock(OP) == lock  # its build gone, the lock is abandoned


def test_no_lock_nothing_to_remove(extensions):
    assert ops.stale_lock_reason(extensions / OP) is None
    assert ops.remove_stale_lock(OP) is None


MOUNTS = r"""/dev/vda / ext4 rw,relatime 0 0
server:/home /home nfs4 rw,relatime 0 0
tmpfs /home/scratch tmpfs rw 0 0
/dev/vdb /home/my\040disk xfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/u/.cache/torch_extensions", "nfs4"),
        ("/home/scratch/x", "tmpfs"),
        ("/homework", "ext4"),
        ("/home/my disk/x", "xfs"),
        ("/", "ext4"),
    ],
)
def test_the_filesystem_of_a_path_is_its_deepest_mount(path, kind):
    """A lock on a shared filesystem (nfs4 here) may be held on another host: it is kept for
    SHARED_LOCK_STALE_S; on a local one, no holder on this host means abandoned."""
    assert ops.filesystem_type(Path(path), MOUNTS) == kind
    assert (kind in ops.NETWORK_FILESYSTEMS) == (kind == "nfs4")


@pytest.mark.slow
def copy_machine_build(name: str, extensions: Path) -> None:
    """The machine's build of op ``name`` (a builder's name), if there is one, into the test's
    extensions root, its lock left out (else the op is built there when loaded)."""
    with pytest.MonkeyPatch.context() as env:
        if MACHINE_EXTENSIONS:
            env.setenv("TORCH_EXTENSIONS_DIR", MACHINE_EXTENSIONS)
        else:
            env.delenv("TORCH_EXTENSIONS_DIR")
        built = ops.build_dir(name)
    if built.is_dir():
        shutil.copytree(
            built, extensions / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock")
        )


def test_building_the_ops_ahead_gets_past_a_stale_lock(extensions):
    """`python -m offload_study.admission.ops` (make's step) with a killed build's lock in a copy of the
    built op: it says it removed the lock and loads the op (before: waited forever)."""
    copy_machine_build(OP, extensions)
    killed_build(extensions / OP)
    res = subprocess.run(
        [sys.executable, "-m", "offload_study.admission.ops", "--accelerator", "cpu", "shm_comm"],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"removed the stale build lock {extensions / OP / 'lock'}" in res.stderr
    assert "shm_comm: ready in" in res.stdout
    assert not (extensions / OP / "lock").exists()


@pytest.mark.slow
def test_the_ops_build_side_by_side_and_a_failed_one_is_named(capsys):
    """make's step builds the ops at once, one process each (loaded here from the build make
    did): each is printed as ready; an op that fails raises with its name once the others end."""
    assert set(ops.build_ops_at_once(["shm_comm", "cpu_adam"], "cpu")) == {"shm_comm", "cpu_adam"}
    out = capsys.readouterr().out
    assert "shm_comm: ready in" in out and "cpu_adam: ready in" in out
    with pytest.raises(RuntimeError, match="nope"):
        ops.build_ops_at_once(["shm_comm", "nope"], "cpu")
    assert "shm_comm: ready in" in capsys.readouterr().out


def test_little_free_memory_builds_the_ops_one_after_the_other(monkeypatch):
    """Under AT_ONCE_MIN_FREE_GIB free, one process builds them in turn (each compiler holds up
    to ~1.7 GiB; at once they would be 8 on 2 cores)."""
    from offload_study.prediction import calibrate

    calls = []

    def build(names, accelerator=None):
        calls.append(list(names))
        return dict.fromkeys(names, 1.0)

    monkeypatch.setattr(calibrate, "host_bytes_free", lambda: 2**30)
    monkeypatch.setattr(ops, "build_ops", build)
    assert ops.build_ops_at_once(["cpu_adam", "async_io"]) == {"cpu_adam": 1.0, "async_io": 1.0}
    assert calls == [["cpu_adam", "async_io"]]


@pytest.mark.slow
def test_a_run_gets_past_a_stale_lock_of_an_op_it_loads(extensions, tmp_path):
    """A run one of whose ops had its build killed earlier (a timed-out or preempted run): the
    runner removes the abandoned lock before it launches, says so, and the run trains (before:
    its ranks waited on the lock until the run's timeout, and so did every later run)."""
    spec_path, outdir, spec = make_run(tmp_path)
    names = [ops.op_builder(op, spec.accelerator).name for op in preflight.ops_needed(spec)]
    for name in names:
        copy_machine_build(name, extensions)
    killed_build(extensions / names[-1])
    res = run_runner(spec_path, outdir)
    assert res.returncode == 0, res.stderr[-3000:]
    assert load_record(outdir)["outcome"] == "ok"
    removed = f"removed the stale build lock {extensions / names[-1] / 'lock'}"
    assert removed in (outdir / "logs" / "launcher.log").read_text()
