"""`HubOperation`: upstream's model/dataset hub access, offline.

Resource names take upstream's prefixes: ``ms://`` (ModelScope, the default) and ``hf://``
(Hugging Face). Local paths work everywhere; anything that would reach a hub raises
``HubUnavailableError`` naming what is missing, since this build has no network hub.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
from typing import Any

# Upstream submits `async_push_to_hub` uploads to a process pool bound here (its tests replace
# it); this offline build uploads nothing, so no pool is started.
_executor: concurrent.futures.Executor | None = None


class HubUnavailableError(RuntimeError):
    """A hub (ModelScope or Hugging Face) was needed; this build works offline."""


def _offline(what: str, resource: str) -> HubUnavailableError:
    return HubUnavailableError(
        f"{what} {resource!r} needs a model hub (ModelScope / Hugging Face), which this build "
        "does not reach; pass a local directory or file path instead"
    )


class HubOperation:
    """Upstream's hub facade: resolves ``ms://`` / ``hf://`` names, serves local paths."""

    @staticmethod
    def source_type(resource_name: str | None) -> str:
        """``'hf'`` for ``hf://`` names, else ``'ms'`` (upstream's default hub).

        Raises ``ValueError`` for an ``hf://`` name when ``TWINKLE_FORBID_HF`` is set (not '0').
        """
        source = "hf" if (resource_name or "").startswith("hf://") else "ms"
        if source == "hf" and os.environ.get("TWINKLE_FORBID_HF", "0") != "0":
            raise ValueError("Using hf as hub backend is not supported.")
        return source

    @staticmethod
    def remove_source_type(resource_name: str | None) -> str | None:
        """`resource_name` without its ``xx://`` prefix."""
        if not resource_name:
            return resource_name
        return resource_name.split("://")[-1]

    @classmethod
    def download_model(
        cls,
        model_id_or_path: str | None = None,
        revision: str | None = None,
        download_model: bool = True,
        ignore_patterns: list[str] | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The local directory of a model: an existing path is returned as it is.

        Raises ``HubUnavailableError`` for a hub id (nothing is downloaded here).
        """
        if model_id_or_path and os.path.exists(model_id_or_path):
            return model_id_or_path
        raise _offline("model", str(model_id_or_path))

    @classmethod
    def download_file(
        cls,
        repo_id: str,
        repo_type: str = "model",
        allow_patterns: list[str] | str | None = None,
        token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """A local directory holding `repo_id`'s files: an existing path is returned as it is.

        Raises ``HubUnavailableError`` for a hub id.
        """
        if os.path.exists(repo_id):
            return repo_id
        raise _offline(repo_type, repo_id)

    @classmethod
    def load_dataset(
        cls,
        dataset_id: str,
        subset_name: str,
        split: str,
        streaming: bool = False,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """A hub dataset through the ``datasets`` package (Hugging Face ids, its cache).

        Raises ``HubUnavailableError`` for ``ms://`` ids (no ModelScope client here) and
        ``ValueError`` when the ``datasets`` package is not installed.
        """
        if dataset_id.startswith("ms://"):
            raise _offline("dataset", dataset_id)
        if importlib.util.find_spec("datasets") is None:
            raise ValueError(
                f"dataset_id={dataset_id!r} is not a local file or directory, and loading hub "
                "datasets needs the `datasets` package (pip install datasets); or pass rows as "
                "DatasetMeta(data=...)"
            )
        import datasets

        name = None if subset_name == "default" else subset_name
        return datasets.load_dataset(
            cls.remove_source_type(dataset_id),
            name,
            split=split,
            streaming=streaming,
            revision=revision,
            **kwargs,
        )

    @classmethod
    def try_login(cls, token: str | None = None) -> bool:
        """Raises ``HubUnavailableError``: there is no hub to log in to."""
        raise _offline("login with token", "***" if token else "")

    @classmethod
    def create_model_repo(
        cls, repo_id: str, token: str | None = None, private: bool = False
    ) -> str:
        """Raises ``HubUnavailableError``: repositories live on a hub."""
        raise _offline("repository", repo_id)

    @classmethod
    def push_to_hub(cls, repo_id: str, folder_path: str, *args: Any, **kwargs: Any) -> None:
        """Raises ``HubUnavailableError``: uploading needs a hub."""
        raise _offline("upload to", repo_id)

    @classmethod
    def async_push_to_hub(cls, repo_id: str, folder_path: str, *args: Any, **kwargs: Any) -> None:
        """Raises ``HubUnavailableError``: uploading needs a hub."""
        raise _offline("upload to", repo_id)
