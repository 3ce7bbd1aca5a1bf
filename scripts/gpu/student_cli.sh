#!/usr/bin/env bash
# The GPU suite's cli step (scripts/gpu-suite.sh run cli): the student
# command itself on the GPU, as a user runs it, where the other training
# steps run test binaries (trainer.Run) and leave out the command's own
# glue (its flags, signals, exit statuses, resume command):
#
#   bash scripts/gpu/student_cli.sh STUDENT CACHE WORK
#
# STUDENT is the student binary, CACHE a tiny teacher cache (the bundle's
# cli-cache, made by scripts/gpu/clifixture), WORK an empty directory for
# the runs. A tiny random-init Qwen3 student (cmd/student's sigConfig)
# with NVFP4 QAD (quant: nvfp4) and train.device cuda:
#
#   1. student train --nproc-per-node 1 --max-steps 3: exits 0, with a
#      checkpoint of step 3
#   2. student train with no step limit, sent SIGTERM once step 2 is
#      logged: prints "stopped by SIGTERM after step K", writes the
#      checkpoint of step K, exits 0 (train.sigterm_exit_status's default)
#   3. the printed "resume with:" command plus --max-steps K+2: resumes
#      from step K's checkpoint, exits 0
#   4. student export --format bf16, then --format nvfp4, of that run:
#      each exits 0, with config.json and model.safetensors written (and
#      nvfp4's hf_quant_config.json)
#   5. student eval of that run on the cache, on the GPU (--device cuda):
#      exits 0
#
# Each check prints "ok: ..." or "FAIL: ..." and the command's output; the
# exit status is 1 when any failed. On a GPU the whole should take about
# 20 s (not yet timed on one), most of it the kernels' first compile
# (DISTILL_KERNEL_CACHE keeps them for the later runs); on the emulator
# (DISTILL_GPU_SUITE_EMU=1) about 3 s.
set -uo pipefail
[ $# -eq 3 ] || { echo "usage: $0 STUDENT CACHE WORK" >&2; exit 2; }
student=$1 cache=$2 work=$3
failed=0

ok() { echo "ok: $*"; }
fail() { echo "FAIL: $*"; failed=1; }

# run NAME CMD...: runs CMD with its output to $work/NAME.out, then prints
# the output; returns CMD's exit status.
run() {
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$work/$name.out" 2>&1
  local rc=$?
  sed 's/^/   /' "$work/$name.out"
  return $rc
}

cat >"$work/run.yaml" <<EOF
run_dir: unused
seed: 4
quant: nvfp4
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [nowhere], seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: constant, warmup_steps: 1}
train: {max_steps: 1000000000, threads: 1, device: cuda}
eval: {every: 0}
checkpoint: {every: 0}
log: {every: 1, progress: "off"}
EOF
train=("$student" train --config "$work/run.yaml" --cache "$cache" --nproc-per-node 1)

# 1. A run to its end.
run train "${train[@]}" --run-dir "$work/short" --max-steps 3
rc=$?
if [ "$rc" != 0 ]; then
  fail "train --max-steps 3: exit status $rc, want 0"
elif [ ! -f "$work/short/checkpoints/step-00000003/model.safetensors" ]; then
  fail "train --max-steps 3: exit status 0 but no checkpoint step-00000003"
else
  ok "train --max-steps 3: exit status 0, checkpoint of step 3"
fi

# 2. An endless run stopped by SIGTERM after its second step.
rundir=$work/run
echo "== sigterm: ${train[*]} --run-dir $rundir (SIGTERM once step 2 is logged)"
"${train[@]}" --run-dir "$rundir" >"$work/sigterm.out" 2>&1 &
pid=$!
for _ in $(seq 600); do # 60 s at most
  grep -q '^step 2/1000000000 ' "$work/sigterm.out" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if grep -q '^step 2/1000000000 ' "$work/sigterm.out"; then
  kill -TERM "$pid"
else
  kill -KILL "$pid" 2>/dev/null
fi
wait "$pid"
rc=$?
sed 's/^/   /' "$work/sigterm.out"
stopped=$(grep -m1 -oE 'stopped by SIGTERM after step [0-9]+ ' "$work/sigterm.out")
resume=$(grep -m1 '^resume with: ' "$work/sigterm.out")
resume=${resume#resume with: }
k=${stopped#stopped by SIGTERM after step }
k=${k% }
ck=$rundir/checkpoints/$(printf 'step-%08d' "${k:-0}")
if ! grep -q '^step 2/1000000000 ' "$work/sigterm.out"; then
  fail "sigterm: the run did not log step 2 (exit status $rc)"
elif [ "$rc" != 0 ]; then
  fail "sigterm: exit status $rc after SIGTERM, want 0 (train.sigterm_exit_status's default)"
elif [ -z "$stopped" ] || [ -z "$resume" ]; then
  fail "sigterm: exit status 0 but no \"stopped by SIGTERM after step K\" and \"resume with:\" lines"
elif [ ! -f "$ck/model.safetensors" ]; then
  fail "sigterm: stopped after step $k but no checkpoint $ck"
else
  ok "sigterm: stopped after step $k, exit status 0, checkpoint $ck"
fi

# 3. The printed resume command, to two steps past the stop.
if [ -n "$resume" ] && [ -n "$k" ]; then
  run resume sh -c "$resume --max-steps $((k + 2))"
  rc=$?
  if [ "$rc" != 0 ]; then
    fail "resume: exit status $rc, want 0"
  elif ! grep -qF "resumed from $ck" "$work/resume.out"; then
    fail "resume: exit status 0 but no \"resumed from $ck\""
  elif [ ! -f "$rundir/checkpoints/$(printf 'step-%08d' $((k + 2)))/model.safetensors" ]; then
    fail "resume: exit status 0 but no checkpoint of step $((k + 2))"
  else
    ok "resume: from step $k to $((k + 2)), exit status 0"
  fi
else
  fail "resume: no resume command to run"
fi

# 4. Export of the run's newest checkpoint, BF16 and NVFP4.
for format in bf16 nvfp4; do
  run "export-$format" "$student" export --checkpoint "$rundir" --out "$work/hf-$format" --format "$format" --no-tokenizer
  rc=$?
  want=(config.json model.safetensors)
  [ "$format" = nvfp4 ] && want+=(hf_quant_config.json)
  missing=()
  for f in "${want[@]}"; do
    [ -f "$work/hf-$format/$f" ] || missing+=("$f")
  done
  if [ "$rc" != 0 ]; then
    fail "export --format $format: exit status $rc, want 0"
  elif [ ${#missing[@]} -gt 0 ]; then
    fail "export --format $format: exit status 0 but no ${missing[*]} in $work/hf-$format"
  else
    ok "export --format $format: exit status 0, ${want[*]}"
  fi
done

# 5. Eval of the run on the cache.
run eval "$student" eval --checkpoint "$rundir" --cache "$cache" --range 0:8 --device cuda
rc=$?
if [ "$rc" != 0 ]; then
  fail "eval: exit status $rc, want 0"
else
  ok "eval: exit status 0"
fi

exit $failed
