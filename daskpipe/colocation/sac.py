"""SAC-Discrete (Christodoulou 2019) for InSS's placement layer, trained in simulation.

The environment is the interference model: a step's action gives every model a GPU and one of
``levels`` share levels; units are normalised per GPU (``InssScorer.normalise``), BDA picks batches,
and the reward is InSS's (Eq. 3) normalised throughput minus ω times the expected violation
fraction, divided by the number of models. The state is InSS's: per model the arrival
rate, the queued work (zero in this fluid environment) and its current GPU, per GPU the free memory.
Rates random-walk by ``rate_jitter`` around the requested ones so the agent sees nearby loads. The
action space is factorised (one GPU head and one level head per model, as InSS's released code),
with clipped double-Q, the expectation over next actions in the target, learned temperature and
Polyak targets. Replay is uniform (the code's prioritised replay is omitted). As InSS's code
checkpoints its actor, we evaluate the greedy action at the requested rates after every episode
and keep the best one seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskpipe.colocation.bda import InssScorer
from daskpipe.colocation.policy import Workload


@dataclass(frozen=True)
class SacConfig:
    """Defaults follow InSS Table 1 (lr 1e-4, γ 0.99, κ 0.01, batch 100, replay 10k, 512/256 hidden,
    200-step episodes, ω = 100); ``steps`` is far fewer than the paper's 1500 x 200."""

    steps: int = 2000
    hidden: tuple[int, ...] = (512, 256)
    batch_size: int = 100
    replay: int = 10_000
    lr: float = 1e-4
    gamma: float = 0.99
    polyak: float = 0.01
    init_temperature: float = 1.0
    target_entropy_ratio: float = 0.98
    episode_len: int = 200
    warmup: int = 200
    rate_jitter: float = 0.2
    levels: int = 17
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.levels < 2 or not self.hidden:
            raise ValueError(f"SacConfig needs steps >= 1, batch_size >= 1, levels >= 2 and hidden layers; got {self}")


class PlacementEnv:
    """InSS's MDP over a scorer; rates drift by up to ``rate_jitter`` per episode around the base."""

    def __init__(self, scorer: InssScorer, config: SacConfig, rng: np.random.Generator) -> None:
        self.base, self.config, self.rng = scorer, config, rng
        self.num_models, self.num_gpus = len(scorer.workloads), len(scorer.gpus)
        self.heads = [self.num_gpus, config.levels] * self.num_models
        self.scorer = scorer
        self.assign = [0] * self.num_models
        self.memory_used = [0.0] * self.num_gpus

    @property
    def state_dim(self) -> int:
        return 3 * self.num_models + self.num_gpus

    def state(self) -> np.ndarray:
        per_model = []
        for i, w in enumerate(self.scorer.workloads):
            per_model += [w.rate / 1000.0, 0.0, self.assign[i] / max(1, self.num_gpus - 1)]
        free = [1.0 - used / self.scorer.model.gpu(g.type).memory_mb for used, g in zip(self.memory_used, self.scorer.gpus)]
        return np.asarray(per_model + free, dtype=np.float32)

    def reset(self, jitter: bool) -> np.ndarray:
        if jitter and self.config.rate_jitter > 0:
            factors = 1.0 + self.rng.uniform(-self.config.rate_jitter, self.config.rate_jitter, size=self.num_models)
            workloads = [Workload(w.name, w.rate * f, w.slo_ms) for w, f in zip(self.base.workloads, factors)]
            self.scorer = InssScorer(
                self.base.model, workloads, self.base.gpus, omega=self.base.omega, max_utilisation=self.base.max_utilisation
            )
        else:
            self.scorer = self.base
        self.assign = [0] * self.num_models
        self.memory_used = [0.0] * self.num_gpus
        return self.state()

    def decode(self, action: np.ndarray) -> tuple[list[int], list[int]]:
        assign = [int(a) for a in action[0::2]]
        units = [max(1, math.ceil((int(level) + 1) * self.scorer.units[k] / self.config.levels)) for k, level in zip(assign, action[1::2])]
        return assign, self.scorer.normalise(assign, units)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, float]:
        assign, units = self.decode(action)
        h, v = self.scorer.reward_terms(assign, units)
        reward = (sum(h) - self.scorer.omega * sum(v)) / self.num_models
        decisions = self.scorer.decisions(assign, units)
        self.assign = assign
        self.memory_used = [0.0] * self.num_gpus
        for i, w in enumerate(self.scorer.workloads):
            self.memory_used[assign[i]] += self.scorer.model.memory_mb(w.name, self.scorer.gpus[assign[i]].type, decisions[i].batch or 1)
        return self.state(), reward, float(sum(v))


def train_and_act(scorer: InssScorer, config: SacConfig) -> tuple[list[int], list[int], dict[str, Any]]:
    """Train SAC-Discrete on ``scorer``'s environment; return the trained actor's greedy action at
    the requested rates (normalised) and training figures."""
    import torch
    from torch import nn

    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    env = PlacementEnv(scorer, config, rng)
    heads = env.heads
    offsets = np.cumsum([0] + heads)
    width = int(offsets[-1])

    def mlp() -> nn.Module:
        layers: list[nn.Module] = []
        size = env.state_dim
        for hidden in config.hidden:
            layers += [nn.Linear(size, hidden), nn.ReLU()]
            size = hidden
        layers.append(nn.Linear(size, width))
        return nn.Sequential(*layers)

    actor, q1, q2 = mlp(), mlp(), mlp()
    q1_target, q2_target = mlp(), mlp()
    q1_target.load_state_dict(q1.state_dict())
    q2_target.load_state_dict(q2.state_dict())
    log_alpha = torch.tensor(math.log(config.init_temperature), requires_grad=True)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=config.lr)
    critic_opt = torch.optim.Adam(list(q1.parameters()) + list(q2.parameters()), lr=config.lr)
    alpha_opt = torch.optim.Adam([log_alpha], lr=config.lr)
    target_entropy = [config.target_entropy_ratio * math.log(n) for n in heads]

    def per_head(logits: torch.Tensor) -> list[torch.Tensor]:
        return [logits[:, offsets[h] : offsets[h + 1]] for h in range(len(heads))]

    capacity = config.replay
    states = np.zeros((capacity, env.state_dim), np.float32)
    next_states = np.zeros_like(states)
    actions = np.zeros((capacity, len(heads)), np.int64)
    rewards = np.zeros(capacity, np.float32)
    dones = np.zeros(capacity, np.float32)
    stored = 0
    episode_rewards: list[float] = []
    best: tuple[float, list[int], list[int]] | None = None
    state = env.reset(jitter=True)
    running = 0.0
    for step in range(config.steps):
        if step < config.warmup:
            action = np.array([rng.integers(n) for n in heads])
        else:
            with torch.no_grad():
                logits = per_head(actor(torch.as_tensor(state)[None]))
            action = np.array([int(torch.distributions.Categorical(logits=lg[0]).sample()) for lg in logits])
        next_state, reward, _ = env.step(action)
        done = float((step + 1) % config.episode_len == 0)
        slot = stored % capacity
        states[slot], actions[slot], rewards[slot], next_states[slot], dones[slot] = state, action, reward, next_state, done
        stored += 1
        running += reward
        state = next_state
        if done or step == config.steps - 1:
            episode_rewards.append(float(running / (step % config.episode_len + 1)))
            running = 0.0
            best = _checkpoint(env, actor, per_head, best)
            state = env.reset(jitter=True)
        if stored >= config.batch_size:
            idx = rng.integers(min(stored, capacity), size=config.batch_size)
            _update(
                torch.as_tensor(states[idx]),
                torch.as_tensor(actions[idx]),
                torch.as_tensor(rewards[idx]),
                torch.as_tensor(next_states[idx]),
                torch.as_tensor(dones[idx]),
                actor,
                q1,
                q2,
                q1_target,
                q2_target,
                log_alpha,
                actor_opt,
                critic_opt,
                alpha_opt,
                per_head,
                target_entropy,
                config,
            )
    score, assign, units = best
    return (
        assign,
        units,
        {
            "sac_steps": config.steps,
            "checkpoint_score": round(score, 4),
            "episode_mean_rewards": [round(r, 4) for r in episode_rewards],
            "temperature": round(float(log_alpha.detach().exp()), 4),
        },
    )


def _checkpoint(env: PlacementEnv, actor, per_head, best: tuple[float, list[int], list[int]] | None) -> tuple[float, list[int], list[int]]:
    """The greedy action at the requested rates, if it scores better than ``best``."""
    import torch

    env.reset(jitter=False)
    with torch.no_grad():
        greedy = np.array([int(lg[0].argmax()) for lg in per_head(actor(torch.as_tensor(env.state())[None]))])
    assign, units = env.decode(greedy)
    score = float(env.scorer.score(assign, units))
    return (score, assign, units) if best is None or score > best[0] else best


def _update(
    s,
    a,
    r,
    s2,
    done,
    actor,
    q1,
    q2,
    q1_target,
    q2_target,
    log_alpha,
    actor_opt,
    critic_opt,
    alpha_opt,
    per_head,
    target_entropy,
    config: SacConfig,
) -> None:
    """One gradient step of critics, actor and temperature, then the Polyak update (Eqs. 6-9)."""
    import torch

    alpha = log_alpha.exp().detach()
    with torch.no_grad():
        next_logits = per_head(actor(s2))
        next_q = [torch.min(x, y) for x, y in zip(per_head(q1_target(s2)), per_head(q2_target(s2)))]
        targets = []
        for lg, q in zip(next_logits, next_q):
            probs, log_probs = lg.softmax(-1), lg.log_softmax(-1)
            value = (probs * (q - alpha * log_probs)).sum(-1)
            targets.append(r + config.gamma * (1.0 - done) * value)
    critic_loss = 0.0
    for net in (q1, q2):
        for h, q in enumerate(per_head(net(s))):
            taken = q.gather(1, a[:, h : h + 1]).squeeze(1)
            critic_loss = critic_loss + 0.5 * ((taken - targets[h]) ** 2).mean()
    critic_opt.zero_grad()
    critic_loss.backward()
    critic_opt.step()

    logits = per_head(actor(s))
    with torch.no_grad():
        q_min = [torch.min(x, y) for x, y in zip(per_head(q1(s)), per_head(q2(s)))]
    actor_loss = 0.0
    alpha_loss = 0.0
    for h, (lg, q) in enumerate(zip(logits, q_min)):
        probs, log_probs = lg.softmax(-1), lg.log_softmax(-1)
        actor_loss = actor_loss + (probs * (alpha * log_probs - q)).sum(-1).mean()
        expected_log_prob = (probs * log_probs).sum(-1).detach()
        alpha_loss = alpha_loss - (log_alpha * (expected_log_prob + target_entropy[h])).mean()
    actor_opt.zero_grad()
    actor_loss.backward()
    actor_opt.step()
    alpha_opt.zero_grad()
    alpha_loss.backward()
    alpha_opt.step()
    with torch.no_grad():
        for net, target in ((q1, q1_target), (q2, q2_target)):
            for p, tp in zip(net.parameters(), target.parameters()):
                tp.mul_(1 - config.polyak).add_(config.polyak * p)
