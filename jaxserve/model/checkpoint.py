"""Saves the converted parameter pytree as an Orbax checkpoint; restores it into given shardings.

Loading from Hugging Face safetensors converts every tensor (fuses q/k/v and
gate/up, transposes, casts, stacks the layers when scanned). This module saves
the result once and restores it on later starts straight into the caller's
shardings: each device reads only its own shard from disk, so a
tensor-parallel worker never holds a full copy of a parameter on one device
(nor, on many hosts, a host a full copy of the model).

A checkpoint is a directory of two entries:

- ``params/``: the Orbax checkpoint of the pure-dict parameter pytree
  (``StandardCheckpointer``: OCDBT + Zarr3, one array per leaf, each with
  its shape and dtype in Orbax's own metadata);
- ``jaxserve_checkpoint.json``: what the parameters are, so that a restore
  can refuse a checkpoint of another model, dtype or layer layout —
  ``{"format_version", "config" (ModelConfig.to_json()), "dtype",
  "scan_layers", "layout" (the caller's dict, e.g. {"tensor_parallel_size":
  2}, or null)}``. It is written after the arrays are committed, so its
  presence marks a complete checkpoint.

The layer index keys (ints) of the unrolled model go into Orbax as they are:
Orbax stores them as path strings ("0", "1", …) and, given a target with int
keys, restores each array by its path (tested with 12 layers, where "10"
sorts before "2" as a string).
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxserve.config import ModelConfig
from jaxserve.model_files import CHECKPOINT_FILE

FORMAT_VERSION = 1
METADATA_FILE = CHECKPOINT_FILE  # the file model directories are checked for
PARAMS_DIR = "params"


def save_params(directory: str | os.PathLike, params: dict, *, config: ModelConfig,
                dtype: str, scan_layers: bool, layout: dict | None = None,
                force: bool = False) -> None:
    """Writes ``params`` and their metadata as a checkpoint in ``directory``.

    Blocks until the checkpoint is on disk (Orbax saves asynchronously; this
    waits for it). Every process of a multi-host run must call it with its
    addressable shards; the metadata file is written by process 0 only.

    Args:
      directory: the checkpoint directory; created if missing, may exist empty.
      params: the pure-dict parameter pytree of ``load_model`` (jax arrays,
        any sharding); int keys (layer indices) are fine.
      config: the model's architecture.
      dtype: the parameters' dtype name ("float32", "bfloat16", "float16").
      scan_layers: whether ``params`` are of the scanned model (``[L, ...]``
        stacked layers).
      layout: what else a restore must match, JSON-serialisable, e.g.
        ``{"tensor_parallel_size": 2}``; None for nothing.
      force: replace an existing checkpoint in ``directory``.

    Raises:
      FileExistsError: ``directory`` is not empty and ``force`` is False, or it
        is not empty and holds no jaxserve checkpoint (never deleted, even
        with ``force``).
      ValueError: ``dtype`` differs from the dtype of a leaf of ``params``
        (with ``layout["quantization"]`` set, int8, packed-int4 uint8 or float8_e4m3fn
        kernels and float32 scales are expected beside ``dtype`` leaves).
      TypeError: ``layout`` is not JSON-serialisable (nothing is written).
    """
    directory = pathlib.Path(directory).absolute()
    allowed = {np.dtype(dtype)}
    if (layout or {}).get("quantization"):  # jaxserve.model.quantization: i8 / u8 / e4m3 + f32
        allowed |= {np.dtype(np.int8), np.dtype(np.uint8), np.dtype(jnp.float8_e4m3fn),
                    np.dtype(np.float32)}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if np.dtype(leaf.dtype) not in allowed:
            raise ValueError(f"{jax.tree_util.keystr(path)} is {leaf.dtype}, but dtype={dtype!r}")
    meta = {"format_version": FORMAT_VERSION, "config": json.loads(config.to_json()),
            "dtype": str(np.dtype(dtype)), "scan_layers": bool(scan_layers),
            "layout": layout}
    text = json.dumps(meta, indent=1, sort_keys=True)  # fails here, before any write, if not JSON
    if check_destination(directory, force):
        if jax.process_index() == 0:
            (directory / METADATA_FILE).unlink(missing_ok=True)  # incomplete until rewritten
    if jax.process_count() > 1:  # every host has checked before any host writes
        multihost_utils.sync_global_devices(f"jaxserve save_params {directory}")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / PARAMS_DIR, params, force=force)
        checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        (directory / METADATA_FILE).write_text(text + "\n")


def check_destination(directory: str | os.PathLike, force: bool) -> bool:
    """Whether ``directory`` holds a checkpoint ``force`` may replace; raises if it cannot be written.

    Raises:
      FileExistsError: ``directory`` is a file; or it is not empty and holds
        no jaxserve checkpoint (never replaced); or it holds one and ``force``
        is False.
    """
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} is a file, not a directory")
    if not directory.exists() or not any(directory.iterdir()):
        return False
    if not (directory / METADATA_FILE).is_file() and not (directory / PARAMS_DIR).is_dir():
        raise FileExistsError(f"{directory} is not empty and holds no jaxserve checkpoint")
    if not force:
        raise FileExistsError(f"{directory} already holds a checkpoint; replace it with "
                              f"force=True (jaxserve save-checkpoint --force)")
    return True


def read_metadata(directory: str | os.PathLike) -> dict:
    """The metadata dict ``save_params`` wrote (see the module docstring for its fields).

    Raises:
      FileNotFoundError: no metadata file (not a checkpoint, or a save that did
        not finish).
      ValueError: a format version this code does not read.
    """
    path = pathlib.Path(directory) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a jaxserve checkpoint, or an unfinished save")
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {meta.get('format_version')!r}, "
                         f"this jaxserve reads {FORMAT_VERSION}")
    return meta


def check_metadata(meta: dict, *, config: ModelConfig, dtype: str, scan_layers: bool,
                   layout: dict | None = None) -> None:
    """Checks a checkpoint's metadata against what the caller is about to build.

    Raises:
      ValueError: the first field that differs, named with both values
        ("config.num_layers" for a config field, "layout" for the layout).
    """
    expected = {"config": json.loads(config.to_json()), "dtype": str(np.dtype(dtype)),
                "scan_layers": bool(scan_layers), "layout": layout}
    for field, want in expected.items():
        got = meta.get(field)
        if field == "config" and isinstance(got, dict):
            for key in sorted(set(want) | set(got)):
                if got.get(key) != want.get(key):
                    raise ValueError(f"checkpoint config.{key} is {got.get(key)!r}, "
                                     f"expected {want.get(key)!r}")
        elif got != want:
            raise ValueError(f"checkpoint {field} is {got!r}, expected {want!r}")


def restore_params(directory: str | os.PathLike, target: dict) -> dict:
    """Reads the parameters of a checkpoint into the shardings of ``target``.

    Each device reads only the slices of its shards; no device or host holds
    a full copy of a sharded parameter. Check the metadata first
    (``check_metadata(read_metadata(directory), ...)``) to refuse another
    model with a clear message.

    Args:
      directory: a checkpoint directory written by ``save_params``.
      target: the parameter pytree as ``jax.ShapeDtypeStruct`` leaves, each
        with a ``sharding`` (e.g. ``abstract_model``'s pytree with
        ``NamedSharding(mesh, PartitionSpec(...))`` added to each leaf).

    Returns:
      The pytree of ``target`` with jax arrays of its shapes and dtypes, each
      placed with exactly its leaf's sharding.

    Raises:
      ValueError: a target leaf without a sharding; a leaf whose dtype differs
        from the stored one (Orbax would cast silently); a shape or tree
        structure that differs from the stored one (raised by Orbax).
      FileNotFoundError: no checkpoint in ``directory``.
    """
    path = pathlib.Path(directory).absolute() / PARAMS_DIR
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing: not a jaxserve checkpoint")
    for key, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        if getattr(leaf, "sharding", None) is None:
            raise ValueError(f"target leaf {jax.tree_util.keystr(key)} has no sharding")
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path).item_metadata.tree
        stored_dtypes = {_path_str(k): np.dtype(m.dtype)
                         for k, m in jax.tree_util.tree_flatten_with_path(stored)[0]}
        for key, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
            name = _path_str(key)
            if name in stored_dtypes and stored_dtypes[name] != np.dtype(leaf.dtype):
                raise ValueError(f"{name} is stored as {stored_dtypes[name]}, target is {leaf.dtype}")
        return checkpointer.restore(path, target)


def _path_str(key_path: tuple) -> str:
    """A key path as Orbax names it on disk: int and str keys alike, joined by '.'."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)
