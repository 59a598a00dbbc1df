"""The launcher gives each local worker process its own GPUs (data parallel, local multi-host).

Pure logic, no process: ``device_env`` picks the ``CUDA_VISIBLE_DEVICES`` of
the p-th worker process from the tensor-parallel size the engine flags carry.
"""


def test_each_local_worker_process_gets_its_own_gpus():
    from jaxserve.launcher import _tensor_parallel_size, device_env

    assert device_env({}, 0, 2)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert device_env({}, 1, 2)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert device_env({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 1, 2)["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert device_env({"A": "b"}, 3, 1) == {"A": "b", "CUDA_VISIBLE_DEVICES": "3"}
    assert _tensor_parallel_size(("--max-num-seqs", "4", "--tensor-parallel-size", "4")) == 4
    assert _tensor_parallel_size(("-tp", "2")) == 2 and _tensor_parallel_size(()) == 1


def test_a_worker_gets_its_gpus_and_memory_share_and_host_processes_none():
    """worker_env / host_only_env / restore_worker_env: pure environment logic."""
    from jaxserve.launcher import _memory_utilization, host_only_env, worker_env
    from jaxserve.procutil import WORKER_ENV, restore_worker_env

    base = {"PATH": "/bin", "JAX_PLATFORMS": "cuda"}
    worker = worker_env(base, 0, 1, 0.85)
    assert worker["CUDA_VISIBLE_DEVICES"] == "0"  # one TP device, not every GPU
    assert worker["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.85"
    assert worker_env({**base, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 1, 2, 0.9)[
        "XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"  # the user's own setting stays
    host = host_only_env(base, worker)
    assert host["CUDA_VISIBLE_DEVICES"] == "" and host["JAX_PLATFORMS"] == "cpu"
    assert host["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and host["PATH"] == "/bin"
    # A worker the engine starts later gets exactly the first worker's device variables.
    restored = restore_worker_env(host)
    assert WORKER_ENV not in restored
    assert {k: restored.get(k) for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS",
                                         "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                         "XLA_PYTHON_CLIENT_PREALLOCATE")} == {
        "CUDA_VISIBLE_DEVICES": "0", "JAX_PLATFORMS": "cuda",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.85", "XLA_PYTHON_CLIENT_PREALLOCATE": None}
    assert restore_worker_env(base) is base
    assert _memory_utilization(("--gpu-memory-utilization", "0.7")) == 0.7
    assert _memory_utilization(("--gpu-memory-utilization=0.6",)) == 0.6
    assert _memory_utilization(()) == 0.9


def test_launcher_starts_each_process_with_its_devices(monkeypatch, demo_model_dir):
    """Launcher.start: the worker sees its TP GPUs, the api and engine none (processes stubbed)."""
    import io
    import types

    from jaxserve import launcher as launcher_module
    from jaxserve.launcher import Launcher, ServeOptions

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    started = {}

    def spawn(self, name, cmd, env, stdout=None):
        started[name] = env
        proc = types.SimpleNamespace(stdout=io.StringIO(""), pid=1, poll=lambda: None)
        self.processes[name] = proc
        return proc

    monkeypatch.setattr(Launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher_module, "_read_announcement", lambda proc: "127.0.0.1:1")
    options = ServeOptions(model=str(demo_model_dir), engine_flags=(
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8"))
    Launcher(options).start()
    assert set(started) == {"worker", "api", "engine"}
    assert started["worker"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert started["worker"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"
    for name in ("api", "engine"):
        assert started[name]["CUDA_VISIBLE_DEVICES"] == "", name
        assert started[name]["JAX_PLATFORMS"] == "cpu", name

    started.clear()
    Launcher(ServeOptions(model=str(demo_model_dir), in_process_worker=True)).start()
    assert started["engine"]["CUDA_VISIBLE_DEVICES"] == "0"  # the engine is the worker here
    assert started["api"]["CUDA_VISIBLE_DEVICES"] == ""
