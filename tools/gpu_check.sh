#!/usr/bin/env bash
# The GPU check (`make gpu-check`): the project's GPU path end to end on one GPU, one summary line per check,
# exit status 1 if any failed. Meant for a lent one-GPU machine with torch, transformers and peft but maybe no vLLM
# and no network; it also runs on a CPU-only machine, where everything runs on the CPU and the CUDA-only lines say
# "skipped: no GPU" (what CI can see).
#
# Checks, in order (the tiny built-in base, a few steps; about 5 minutes on one GPU is the budget):
#   deps     tyro and math-verify importable; else installed from gpu-wheels/ (make gpu-wheels, on a machine with
#            network) with pip --no-index into runs/gpu-check/pydeps, only the wheels this Python lacks.
#            gpu-wheels/ is git-ignored: it reaches the lent machine only when named in what the copy of the
#            working tree carries (a device runner's extra paths), not with the tracked files
#   cuda     a CUDA device torch can use, and a bf16 matmul on it                          (skipped: no GPU)
#   demo     the demo's tiny base and sum3 problems into the cache (demo/bases.py tiny, demo/tasks.py sum3), as
#            make demo builds them: train.py reads them there
#   train    torchrun --nproc_per_node 1 train.py: 4 steps, checkpoints at 2 and 4; on a GPU in bf16 under FSDP2's
#            mixed-precision policy (--mixed-precision auto) with float32 logits from bf16 operands
#            (fastpaths.bf16_head, fastpaths.head_logits); vLLM engine when importable (compiled as NeMo-RL's
#            recipe: rollout.GPU_COMPILATION), else --engine hf
#   resume   the same command with --steps 6: resumes from step 4
#   export   train.py export of the step-6 checkpoint: an HF folder
#   eval     eval_aime.py on the export (four sum problems, k = 2), with the same engine
#   tests    the suite's tests that need neither vLLM nor torchrun's two ranks: pytest -m "not slow"
#   Under torchrun even one process starts the process group (gloo for CPU tensors, nccl for CUDA ones) and trains
#   through FSDP2 and distributed checkpoints, as each of eight ranks would.
# What it does not check: collectives between two or more GPUs, or anything at the 1.5B scale.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
WHEELS=${GPU_WHEELS:-gpu-wheels}
rm -rf "$OUT" && mkdir -p "$OUT"
failed=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false

# run NAME CMD...: one line, PASS/FAIL with its seconds; the command's output goes to $OUT/NAME.log
run() {
    local name=$1 t0=$SECONDS
    shift
    if "$@" >"$OUT/$name.log" 2>&1; then
        printf '%-7s PASS (%ds)\n' "$name" $((SECONDS - t0))
    else
        printf '%-7s FAIL (%ds): %s (%s)\n' "$name" $((SECONDS - t0)) "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 \
            | cut -c1-160)" "$OUT/$name.log"
        failed=1
    fi
}

if ! "$PY" -c "import tyro, math_verify" 2>/dev/null; then
    missing=$("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md, pathlib, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        md.version(w.name.split("-")[0])  # this Python has it: its own copy stays the one imported
    except md.PackageNotFoundError:
        print(w)
EOF
)
    if [ -z "$missing" ]; then
        echo "deps    FAIL: tyro or math-verify missing and no wheels in $WHEELS/ (make gpu-wheels where there is network;" \
            "the folder is git-ignored: name it in what the copy to this machine carries)"
        exit 1
    fi
    run install "$PY" -m pip install -q --no-index --no-deps --target "$OUT/pydeps" $missing
    export PYTHONPATH="$PWD/$OUT/pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi
run deps "$PY" -c "import tyro, math_verify"

gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
engine=$("$PY" -c "import vllm" 2>/dev/null && echo vllm || echo hf)
echo "on: $("$PY" -c "import sys, torch, transformers; print('Python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)"), ${gpu:-no GPU (CPU)}, engine $engine"
if [ -n "$gpu" ]; then
    run cuda "$PY" -c "import torch; x = torch.randn(256, 256, device='cuda', dtype=torch.bfloat16); \
assert torch.isfinite(x @ x).all() and torch.cuda.is_bf16_supported()"
else
    echo "cuda    skipped: no GPU"
fi

run demo sh -c "\"$PY\" demo/bases.py tiny && \"$PY\" demo/tasks.py sum3"
TRAIN=("$PY" -m torch.distributed.run --nproc_per_node 1 train.py --model tiny --engine "$engine" --prompts-per-step 8
       --group-size 4 --eval-prompts 16 --eval-every 2 --checkpoint-every 2 --keep-checkpoints 3 --out-dir "$OUT/run"
       --quiet --no-plot --gpu-memory-utilization 0.3)
run train "${TRAIN[@]}" --steps 4
run resume "${TRAIN[@]}" --steps 6
grep -q "resumed from" "$OUT/resume.log" || { echo "resume  FAIL: it did not resume from a checkpoint"; failed=1; }
run export "$PY" train.py export "$OUT/run/checkpoints/step_000006" "$OUT/export"
printf '{"problem": "%s", "answer": "%s"}\n' "3+4+5=" 12 "1+2+6=" 9 "7+0+8=" 15 "2+2+2=" 6 > "$OUT/sums.jsonl"
run eval "$PY" eval_aime.py --model "$OUT/export" --data "$OUT/sums.jsonl" --reward exact --k 2 --max-tokens 8 \
    --engine "$engine" --gpu-memory-utilization 0.3 --out "$OUT/eval.jsonl"
run tests "$PY" -m pytest -q -x -m "not slow" tests -p no:cacheprovider
[ -n "$gpu" ] && grep -q '"peak_mem_gib"' "$OUT/run/metrics.jsonl" 2>/dev/null && \
    echo "bf16    $(grep -c token_mult_prob_error "$OUT/run/metrics.jsonl") steps logged on $gpu"
echo "gpu-check: $([ $failed = 0 ] && echo all passed || echo FAILED) in ${SECONDS}s (logs in $OUT)"
exit $failed
