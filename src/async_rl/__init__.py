"""async_rl: asynchronous single-rollout actor-critic RL for LLM post-training, on verl.

Importing the package registers our advantage estimators (``sao_gae``, ``li2sao_group``, ``sapo_turn``)
and policy losses (``ppo_clip``, ``dis``, ``dis_clip``, ``sapo_ar``) in verl's registries; verl also loads them itself through the
``verl.plugins`` entry point.
"""

__version__ = "0.1.0"

from async_rl import verl_plugin as _verl_plugin  # noqa: E402,F401  (registers on import)
