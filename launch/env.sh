# shellcheck shell=bash
# launch/env.sh: the ONE place for the TPU runtime flags and the launch defaults.
#
# Every launch script sources this file, on your machine and again on each TPU host or xpk pod
# (launch/worker.sh), so the flags a run uses are exactly the flags written here; launch/aot.sh
# sources it too, so AOT compiles see the production flags. Edit here, then relaunch:
# launch/run.sh re-syncs the tree, so the edit reaches every worker.
# Every C2_* default below yields to a value already in the environment.

# --- Where things live (paths on the workers) --------------------------------------------------
C2_REMOTE_DIR=${C2_REMOTE_DIR:-c2}              # repo checkout, relative to the worker's $HOME
C2_VENV=${C2_VENV:-$HOME/c2-venv}               # virtualenv, outside the checkout so syncs keep it
C2_LOGS=${C2_LOGS:-$HOME/c2-logs}               # per-host logs before they are copied to WORKDIR
C2_RUNS=${C2_RUNS:-}                            # e.g. gs://my-bucket/runs: TensorBoard's default
C2_XPK_BASE_IMAGE=${C2_XPK_BASE_IMAGE:-python:3.11}  # xpk adds the repo on top of this image

# --- libtpu flags (MaxText benchmarks/xla_flags_library.py and its v5p recipes) ----------------
c2_libtpu_flags=(
  # Continuation fusion: run all-gathers / all-reduces asynchronously, overlapped with compute
  # (FSDP weight gathers, gradient reductions). On by default in recent libtpu; pinned here.
  --xla_tpu_enable_async_collective_fusion=true
  --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true
  --xla_tpu_enable_async_collective_fusion_multiple_steps=true
  --xla_tpu_overlap_compute_collective_tc=true
  --xla_enable_async_all_gather=true
  --xla_enable_async_all_reduce=true
  --xla_enable_async_collective_permute=true    # ring / context-parallel attention hops
  --xla_tpu_enable_ag_backward_pipelining=true  # pipeline (DCN) all-gathers back through scans
  # Pipeline data-parallel (DCN, multislice) all-reduces across iterations.
  --xla_tpu_enable_data_parallel_all_reduce_opt=true
  --xla_tpu_data_parallel_opt_different_sized_ops=true
  # Megacore chips (v4, v5p: two TensorCores act as one device): keep all-gathers out of
  # megacore fusions so they can overlap (MaxText's v5p setting).
  --xla_tpu_megacore_fusion_allow_ags=false
)
# C2_EXTRA_LIBTPU_ARGS='--xla_...' adds flags for a local.sh / aot.sh trial without editing the
# list; pod runs read this file on the workers, so flags meant for a pod belong in the list.
LIBTPU_INIT_ARGS="${c2_libtpu_flags[*]} ${C2_EXTRA_LIBTPU_ARGS:-}"
LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS% }
export LIBTPU_INIT_ARGS

# --- XLA (host side) and JAX -------------------------------------------------------------------
# C2_DUMP_HLO=DIR dumps the optimised HLO of every compiled program there (debugging only).
if [[ -n ${C2_DUMP_HLO:-} ]]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$C2_DUMP_HLO --xla_dump_hlo_as_text"
fi
# C2_JAX_CACHE=gs://bucket/jax-cache shares compiled executables across restarts and hosts.
if [[ -n ${C2_JAX_CACHE:-} ]]; then
  export JAX_COMPILATION_CACHE_DIR=$C2_JAX_CACHE
fi
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}   # keep libtpu's INFO spam out of logs
