"""forge: reinforcement-learning post-training of language models on Monarch actors.

The service layer (``forge.controller``) turns ``ForgeActor`` classes into services with
prebatched endpoints and similarity-aware routing; ``forge.actors`` holds the RL roles
(policy, reference model, trainer, replay buffer, reward) built on it.
"""

__version__ = "0.1.0"
