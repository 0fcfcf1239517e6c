"""``tinker-atropos eval RUN_DIR --video out.mp4``: episodes of a run's policy rendered offscreen, written as an MP4
(imageio, with the ffmpeg binary that imageio-ffmpeg ships) and a GIF beside it, for a README or a report.

No display is needed: MuJoCo renders through EGL, which Mesa's software rasteriser serves on a machine without a
GPU (``MUJOCO_GL=osmesa`` picks OSMesa instead, from Debian's libosmesa6); classic-control envs draw with
pygame's surfaces. The env is the run's (``env.id``, ``env.kwargs``) made by Gymnasium with ``render_mode``
``rgb_array``, one instance, acting as ``eval`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np

from tinker_atropos.config import Config
from tinker_atropos.environment.envs import env_maker
from tinker_atropos.environment.spaces import check_actions
from tinker_atropos.errors import FatalError
from tinker_atropos.models.acting import InferencePolicy

WIDTH, HEIGHT = 480, 320  # multiples of 16, as H.264 encoders want
GIF_FPS, GIF_WIDTH = 20, 240  # a GIF small enough for a README


def use_offscreen_rendering() -> None:
    """EGL unless the user chose: read by mujoco when it is first imported, so call this before. And no pygame
    greeting on stdout, where ``eval --json`` writes."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")


@dataclass(frozen=True)
class Video:
    mp4: Path
    gif: Path
    frames: int
    episode_returns: list[float]


def _render_env(config: Config) -> gym.Env:
    make = env_maker(config.env.id)
    # MuJoCo envs take the frame size, and the locomotion tasks' "track" camera follows the body (the default one
    # stays where the episode began); the others draw at their own size
    for options in ({"width": WIDTH, "height": HEIGHT, "camera_name": "track"}, {}):
        try:
            return make(render_mode="rgb_array", **options, **config.env.kwargs)
        except TypeError:
            continue
        except Exception as error:  # a renderer missing on this machine, an env without rgb_array
            raise FatalError(f"cannot render {config.env.id!r}: {type(error).__name__}: {error}") from None
    raise FatalError(f"cannot render {config.env.id!r}: it takes no render_mode")


def record(
    config: Config,
    policy: InferencePolicy,
    out: Path,
    episodes: int = 1,
    max_frames: int = 1000,
    deterministic: bool = True,
    seed: int = 0,
) -> Video:
    """Play ``episodes`` whole episodes (at most ``max_frames`` frames in all) and write ``out`` and its GIF."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        raise FatalError("--video needs imageio: pip install 'tinker-atropos[video]'") from None
    use_offscreen_rendering()
    env = _render_env(config)
    frames: list[np.ndarray] = []
    returns: list[float] = []
    try:
        layout = env.observation_space if isinstance(env.observation_space, gym.spaces.Dict) else None
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            total, done = 0.0, False
            while not done and len(frames) < max_frames:
                frames.append(env.render())
                flat = gym.spaces.flatten(layout, obs) if layout is not None else obs
                actions, _, _ = policy.act(np.asarray(flat, np.float32)[None], deterministic=deterministic)
                obs, reward, terminated, truncated, _ = env.step(
                    check_actions(actions, env.action_space, 1)[0]
                )
                total += float(reward)
                done = terminated or truncated
            returns.append(total)
        fps = int(env.metadata.get("render_fps") or 30)
    except Exception as error:
        raise FatalError(f"cannot render {config.env.id!r}: {type(error).__name__}: {error}") from None
    finally:
        env.close()
    if not frames:
        raise FatalError(f"{config.env.id!r} rendered no frame")
    out.parent.mkdir(parents=True, exist_ok=True)
    imageio.mimwrite(out, frames, fps=fps, codec="libx264", quality=7, macro_block_size=16)
    step = max(1, round(fps / GIF_FPS))
    small = [
        frame[:: max(1, frame.shape[1] // GIF_WIDTH), :: max(1, frame.shape[1] // GIF_WIDTH)]
        for frame in frames[::step]
    ]
    gif = out.with_suffix(".gif")
    imageio.mimwrite(gif, small, format="GIF", duration=1000 * step / fps, loop=0)
    return Video(out, gif, len(frames), returns)
