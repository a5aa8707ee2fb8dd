#!/usr/bin/env bash
# What an AMX machine is for (issue 31's must-shows, docs/PERFORMANCE.md), most valuable first, each step capped so
# that one short lease of such a machine measures what a 2-core development box cannot:
#
#   scripts/amx_checks.sh OUT_DIR [BUDGET_S [STEPS]]
#
# BUDGET_S (default 540) bounds the whole run; a step that would pass it is cut, and the steps after it are skipped.
# STEPS picks and orders steps (comma-separated; default all, in this order):
#   cpu         lscpu, the caches sysfs gives, AMX flags, NUMA nodes
#   build       the native kernels (MAX_JOBS = the CPUs)
#   exceptions  does a C++ exception reach Python (torch's own, then a tilefx op's refusal)? Two earlier AMX
#               machines killed the process instead; where it does, what the throw ran through (below)
#   tpot1024    Llama-3.2-1B: stock torch.compile vs tilefx bf16/int8/fp8, 1024-token prompt, with --profile (the
#               prefill's ops and a decode step's)
#   moe         Qwen3-30B-A3B cut to 4 layers: HF eager vs tilefx bf16/int8, with --profile
#   tpot128     the same as tpot1024 at a 128-token prompt
#   batch       Llama-3.2-1B at batches 4 and 2 (64-token prompts): stock torch.compile vs tilefx bf16, per step
#   kernels     bench_kernels.py on Llama-3.2-1B's shapes, bf16/int8/fp8, and the MoE presets' routed experts
#   mla         DeepSeek-V2-Lite cut to 4 layers, tilefx bf16, a 4096-token prompt (issue 31's 4 s stretch target)
#   recycle     the same with recycle_buffers off: what the buffer recycler saves where the GEMMs run on AMX
#   optests     the native ops' tests (tests/custom_ops) on every path this CPU has, amx among them, on
#               pytest-xdist workers where it is installed (a .whl/ wheel, say)
#   cppwrapper  tilefx bf16 with Inductor's C++ wrapper against the Python one
# Run from the repository root. Wheels in .whl/ (a newer transformers, say) are installed first, without their
# dependencies, into the python3 on PATH (PYTHON overrides it). Each step's whole output is OUT_DIR/STEP.log; the
# benches' JSON is there too; stdout gets each step's last lines.
set -uo pipefail

out=${1:?usage: scripts/amx_checks.sh OUT_DIR [BUDGET_S [STEPS]]}
budget=${2:-540}
steps=${3:-cpu,build,exceptions,tpot1024,moe,tpot128,batch,kernels,mla,recycle,optests,cppwrapper}
py=${PYTHON:-python3}
export TILEFX_QUIET=1  # no progress bars in the logs
mkdir -p "$out"
started=$(date +%s)

step_cpu() {
  lscpu
  grep -o 'amx[a-z_0-9]*\|avx512_bf16\|avx512_fp16' /proc/cpuinfo | sort | uniq -c
  for index in /sys/devices/system/cpu/cpu0/cache/index*; do
    echo "cache L$(cat "$index/level") $(cat "$index/type"): $(cat "$index/size")"
  done
  ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l | sed 's/^/NUMA nodes: /'
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
}

step_build() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-deps .whl/*.whl || return
  fi
  MAX_JOBS=$(nproc) "$py" setup.py -q build_ext --inplace || return
  "$py" -c "from tilefx.custom_ops import isa; print('kernel path', isa.current())"
}

exception_check() {
  "$py" - <<'EOF'
import torch
try:
    torch.zeros(-1)
except RuntimeError:
    print("torch: its C++ exception reached Python", flush=True)
from tilefx.custom_ops import linear as linear_ops
try:
    linear_ops.linear(torch.randn(1, 8).to(torch.bfloat16), torch.randn(4, 8).to(torch.bfloat16), None, 4)
except RuntimeError as error:
    print("tilefx: its C++ exception reached Python:", str(error).splitlines()[0], flush=True)
EOF
}

# Where a throw kills the process, what the unwinding ran through: the interpreter, the compiler, the C++ runtime
# the extension links, which library the dynamic linker bound the unwinder's entry points to (a second unwinder,
# LLVM's libunwind say, interposing on libgcc_s's breaks every C++ throw), and whether preloading libgcc_s (the
# GNU unwinder first) lets the exceptions through.
step_exceptions() {
  exception_check && return
  local status=$?
  echo "--- the check exited $status; diagnosis:"
  "$py" -c "import sys; print('python', sys.version.replace(chr(10), ' '), sys.executable)"
  "${CXX:-g++}" --version 2> /dev/null | head -n 1
  local library
  library=$("$py" -c "from tilefx.custom_ops import isa; print(isa.native.__file__)" 2> /dev/null)
  [[ -n $library ]] && ldd "$library" | grep -E 'stdc\+\+|gcc_s|unwind|c\+\+'
  LD_DEBUG=bindings LD_DEBUG_OUTPUT="$out/ld_debug" exception_check > /dev/null 2>&1
  grep -h -E "symbol .(_Unwind_RaiseException|__cxa_throw|__gxx_personality_v0)'" "$out"/ld_debug.* 2> /dev/null \
    | sed 's/^ *[0-9]*: *//' | sort | uniq -c
  rm -f "$out"/ld_debug.*
  local gcc_s
  gcc_s=$(ldconfig -p 2> /dev/null | awk '/libgcc_s.so.1 .*x86-64/ {print $NF; exit}')
  if [[ -n $gcc_s ]]; then
    echo "--- again with LD_PRELOAD=$gcc_s"
    LD_PRELOAD=$gcc_s exception_check
  fi
  return "$status"
}

bench_tpot() { "$py" scripts/bench_tpot.py --runs 2 --new-tokens 16 "$@"; }

step_tpot1024() {
  bench_tpot --modes torch.compile,tilefx --weights bf16,int8,fp8 --prompt-len 1024 --profile \
    --json "$out/tpot1024.json"
}

step_moe() {
  bench_tpot --preset qwen3-30b-a3b --layers 4 --modes eager,tilefx --weights bf16,int8 --prompt-len 128 --profile \
    --json "$out/moe.json"
}

step_tpot128() {
  bench_tpot --modes torch.compile,tilefx --weights bf16,int8,fp8 --prompt-len 128 --json "$out/tpot128.json"
}

step_batch() {
  for batch in 4 2; do
    bench_tpot --modes torch.compile,tilefx --weights bf16 --batch "$batch" --prompt-len 64 \
      --json "$out/batch$batch.json" || return
  done
}

step_kernels() {
  "$py" scripts/bench_kernels.py --presets llama-3.2-1b --weights int8,fp8 --json "$out/kernels.json"
}

# DeepSeek-V2-Lite cut to 4 layers, tilefx bf16, a 4096-token prompt (8 new tokens: the prompt is the measure)
deepseek_prompt() {
  bench_tpot --preset deepseek-v2-lite --layers 4 --modes tilefx --prompt-len 4096 --new-tokens 8 "$@"
}

step_mla() {
  deepseek_prompt --json "$out/mla.json"
}

step_recycle() {
  deepseek_prompt --options '{"recycle_buffers": false}' --json "$out/recycle-off.json"
}

step_optests() {
  local workers=()
  if "$py" -c "import xdist" 2> /dev/null; then
    workers=(-n "$(( $(nproc) < 8 ? $(nproc) : 8 ))")  # each worker's ops run 2 threads
  fi
  OMP_NUM_THREADS=2 "$py" -m pytest -q -p no:cacheprovider "${workers[@]}" tests/custom_ops
}

step_cppwrapper() {
  bench_tpot --modes tilefx --weights bf16 --prompt-len 128 --json "$out/python-wrapper.json" &&
    bench_tpot --modes tilefx --weights bf16 --prompt-len 128 --cpp-wrapper --json "$out/cpp-wrapper.json"
}

export py out
export -f bench_tpot deepseek_prompt exception_check $(compgen -A function step_)  # each step runs in its own bash, under timeout
IFS=, read -ra chosen <<< "$steps"
for name in "${chosen[@]}"; do
  if ! declare -F "step_$name" > /dev/null; then
    echo "unknown step '$name'" >&2
    exit 2
  fi
done
for name in "${chosen[@]}"; do
  left=$(( budget - ($(date +%s) - started) ))
  if (( left < 30 )); then
    echo "## $name: skipped, ${left}s of the budget left"
    continue
  fi
  echo "## $name (at most ${left}s)"
  begun=$(date +%s)
  timeout -k 5 "$left" bash -c "step_$name" > "$out/$name.log" 2>&1
  status=$?
  echo "## $name: exit $status after $(( $(date +%s) - begun ))s$( (( status == 124 )) && echo ' (cut: budget)')"
  tail -n 30 "$out/$name.log"
done
