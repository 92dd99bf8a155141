"""How a publication reaches the rollout engine: one :class:`PublicationForm`, picked once when the run is built.

The engine's capabilities are read here and nowhere else; the run core then only calls
:func:`weights_to_publish`, and the engine's ``update_weights`` receives that one form.
"""

from __future__ import annotations

import enum
from typing import Any


class PublicationForm(str, enum.Enum):
    VERSION_ONLY = "version_only"  # the engine gets the weights itself: hybrid replicas read their train rank's
    #                                memory, verl's checkpoint manager pulls from the actor ranks
    OBJECT_STORE = "object_store"  # actor rank 0 puts them in Ray's object store once; each replica reads the handle
    STATE_DICT = "state_dict"  # the trainer's full state dict (the in-driver engine; a pool puts it in the store)


def choose_publication_form(actor: Any, engine: Any) -> PublicationForm:
    """The strategy for this actor and engine: the least movement of weights they both support."""
    if getattr(engine, "takes_version_only", False):
        return PublicationForm.VERSION_ONLY
    if getattr(engine, "accepts_published_weights", False) and hasattr(actor, "publish_weights"):
        return PublicationForm.OBJECT_STORE
    return PublicationForm.STATE_DICT


def weights_to_publish(sync: PublicationForm, actor: Any, version: int) -> Any:
    """What ``engine.update_weights(_, version)`` is given under ``sync``."""
    if sync is PublicationForm.VERSION_ONLY:
        from async_rl.rollout.checkpoint_engine import in_process_handle  # imports Ray: only pools get here

        return in_process_handle(version)
    if sync is PublicationForm.OBJECT_STORE:
        return actor.publish_weights(version)
    return actor.export_weights()
