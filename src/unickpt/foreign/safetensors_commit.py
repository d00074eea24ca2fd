"""A new safetensors model put in place of the one in a folder, so that a crash at any instant
leaves the old model or the new one, never a mix.

Loaders read ``model.safetensors`` before ``model.safetensors.index.json`` (``from_pretrained``
does, and so does :mod:`.safetensors_read`), and a sharded model is what its index names. So:

- one shard is renamed onto ``model.safetensors``: that is the switch; the old index and
  shards are removed after;
- several: each shard takes its final name where that name is free, else a name of this save
  (``model-00001-of-00003-<save id>.safetensors``: an overwrite by as many shards finds every
  name taken); the index naming them replaces the old one: the switch (or, where the old model
  is one file, that file's removal is); then the old files are removed, and the shards under
  this save's names get their final ones: a second name (a hard link), the index again, then
  this save's names removed.

Every step is a rename, a link or a removal, and the folder is synced between the steps a later
one relies on. On a file system without hard links the shards are renamed instead, and the
folder refuses to load (a shard its index names is missing) until the index is written again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..storage.local import fsync_dir
from .common import INDEX_FILE, SINGLE_FILE

log = logging.getLogger(__name__)


def replace_model(
    folder: Path, temps: dict[str, str], weight_map: dict[str, str], total_bytes: int, tag: str
) -> None:
    """Put the shards ``temps`` (final name: the name they were written under in ``folder``,
    synced) in place of the folder's model; ``weight_map`` names each tensor's shard (final
    names), ``tag`` is unique to this save."""
    if list(temps) == [SINGLE_FILE]:
        os.replace(folder / temps[SINGLE_FILE], folder / SINGLE_FILE)
        fsync_dir(folder)
        _remove_stale(folder, {SINGLE_FILE})
        fsync_dir(folder)
        return
    placed = {}
    for name, temp in temps.items():
        placed[name] = name if not (folder / name).exists() else own_name(name, tag)
        os.replace(folder / temp, folder / placed[name])
    fsync_dir(folder)
    _write_index(folder, weight_map, placed, total_bytes)
    (folder / SINGLE_FILE).unlink(missing_ok=True)
    _remove_stale(folder, {*placed.values(), INDEX_FILE})
    fsync_dir(folder)
    moved = {name: own for name, own in placed.items() if own != name}
    if moved:
        _rename_in_place(folder, moved)
        _write_index(folder, weight_map, {name: name for name in temps}, total_bytes)
        for own in moved.values():
            (folder / own).unlink(missing_ok=True)
        fsync_dir(folder)


def own_name(name: str, tag: str) -> str:
    """A shard's name of one save: ``model-00001-of-00003-<tag>.safetensors``."""
    return f"{name.removesuffix('.safetensors')}-{tag}.safetensors"


def _write_index(
    folder: Path, weight_map: dict[str, str], placed: dict[str, str], total_bytes: int
) -> None:
    """The index naming each tensor's shard as ``placed``, replaced atomically (written,
    synced, renamed, the folder synced)."""
    files = {k: placed[f] for k, f in sorted(weight_map.items())}
    doc = {"metadata": {"total_size": total_bytes}, "weight_map": files}
    index_temp = folder / f".{INDEX_FILE}.tmp"
    with open(index_temp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(index_temp, folder / INDEX_FILE)
    fsync_dir(folder)


def _rename_in_place(folder: Path, moved: dict[str, str]) -> None:
    """Give each shard of ``moved`` (final name: this save's name) its final name as a second
    name, the index still naming the first; renames where hard links fail."""
    try:
        for name, own in moved.items():
            os.link(folder / own, folder / name)
    except OSError as e:
        log.warning("%s: hard links failed (%s); renaming the shards instead", folder, e)
        for name, own in moved.items():
            if (folder / own).exists():
                os.replace(folder / own, folder / name)
    fsync_dir(folder)


def _remove_stale(folder: Path, keep: set[str]) -> None:
    """Remove the files of models other than the one in ``keep``: shards (of any save, or
    under a save's own name), a stale index or single file, shards a crash left unfinished."""
    stale = [*folder.glob("model-*-of-*.safetensors"), *folder.glob(".model*.safetensors.*tmp*")]
    stale += [folder / n for n in (INDEX_FILE, SINGLE_FILE) if n not in keep]
    for path in stale:
        if path.name not in keep:
            path.unlink(missing_ok=True)
