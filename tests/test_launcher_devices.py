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
