"""Agentic coding environments: tasks, sandboxed workspaces, grading and rewards.

  sandbox    run_command: one command under CPU/wall/memory/process/file limits, no network, a
             read-only system and only its workspace writable (bubblewrap + rlimits); also
             `python -m c2.envs.sandbox -- CMD` to see what isolation a machine gives.
  workspace  Workspace: a rollout's files; path resolution for the file tools, fork for a group,
             snapshot/restore for environment checkpoints.
  tasks, grading, rewards, ...: the tasks, their graders and the reward (see each module).

Submodules are imported where used; importing the package loads nothing.
"""
