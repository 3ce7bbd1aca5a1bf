package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"distill/internal/cli"
)

// humanBytes reads train.HumanBytes' "1.5 GiB".
func humanBytes(t *testing.T, s string) int64 {
	t.Helper()
	f := strings.Fields(s)
	if len(f) != 2 {
		t.Fatalf("bytes %q", s)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	shift, ok := map[string]int{"KiB": 10, "MiB": 20, "GiB": 30}[f[1]]
	if err != nil || !ok {
		t.Fatalf("bytes %q", s)
	}
	return int64(v * float64(int64(1)<<shift))
}

// TestPlan: `student plan` prints a tiny config's memory plan from the
// config alone (its cache does not exist, no device is opened): every
// term, a line per recompute mode with its total, whether it fits and the
// longest row, and auto's choice, which moves with --device-memory and
// --set; bad flags are errors that say what to give.
func TestPlan(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`run_dir: unused
model:
  random: {arch: qwen3, vocab_size: 1000, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 4,
           num_key_value_heads: 2, head_dim: 16, intermediate_size: 256, max_position_embeddings: 4096}
  tokenizer_fingerprint: none
data: {cache: [/no/such/cache], seq_len: 2048, global_batch_tokens: 8192}
`), 0o644)
	plan := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		stdout = &out
		defer func() { stdout = os.Stdout }()
		if err := runPlan(append([]string{"--config", cfg}, args...)); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	out := plan()
	t.Logf("\n%s", out)
	for _, want := range []string{"rows of 2048 tokens (data.seq_len), teacher top-k 64, quant none", "device: 80.00 GiB",
		"parameters (fp32)", "gradients (fp32)", "AdamW moments (fp32 m, v)", "BF16 weight copies",
		"activations, recompute none", "activations, recompute selective", "activations, recompute full",
		"attention scratch", "loss head tiles", "GEMM operand scratch", "train.recompute auto picks: none",
		"the loss head keeps its logits between its passes on such a device"} {
		if !strings.Contains(out, want) {
			t.Errorf("the plan lacks %q", want)
		}
	}
	for _, mode := range []string{"none", "selective", "full"} {
		if !regexp.MustCompile(`(?m)^` + mode + ` +[0-9.]+ [KMG]iB +yes +[0-9]+`).MatchString(out) {
			t.Errorf("no fitting line for recompute %s", mode)
		}
	}
	// 320 MiB less the 256 MiB reserve: full recompute fits (60.2 MiB with
	// BF16 activations, cuDNN's workspace for rows of 2048 estimated at
	// 32.5 MiB), selective (69.1) and none (81.1) do not.
	out = plan("--device-memory", "320MiB", "--set", "quant=nvfp4")
	if !strings.Contains(out, "quant nvfp4") || !strings.Contains(out, "NVFP4 fake-quantized weights (fp32)") ||
		!regexp.MustCompile(`(?m)^none +[0-9.]+ MiB +no `).MatchString(out) || !strings.Contains(out, "train.recompute auto picks: full") {
		t.Errorf("a 320 MiB device under QAD: want none not fitting and auto picking full:\n%s", out)
	}
	// A real vocabulary: kept logits (4·2048·151936 bytes) outgrow the
	// logit tile. A device with room for recompute none but not for the
	// kept logits beside it: the loss head recomputes them.
	big := []string{"--set", "model.random.vocab_size=151936"}
	out = plan(big...)
	none := regexp.MustCompile(`(?m)^none +([0-9.]+ [KMG]iB) +yes`).FindStringSubmatch(out)
	keep := regexp.MustCompile(`keeps its logits between its passes on such a device \(([0-9.]+ [KMG]iB) with recompute none\)`).FindStringSubmatch(out)
	if none == nil || keep == nil {
		t.Fatalf("vocab 151936 on 80 GiB: want none fitting and the logits kept:\n%s", out)
	}
	mid := (humanBytes(t, none[1]) + humanBytes(t, keep[1])) / 2
	out = plan(append(big, "--device-memory", fmt.Sprintf("%dMiB", (256<<20+mid)>>20))...)
	if !strings.Contains(out, "train.recompute auto picks: none") || !strings.Contains(out, "the loss head recomputes its logits in its second pass on such a device (keeping them needs "+keep[1]) {
		t.Errorf("a device with room for recompute none (%s) but not the kept logits (%s): want none picked and the logits recomputed:\n%s", none[1], keep[1], out)
	}
	// A device the run-long terms alone overflow: no row length helps.
	if out := plan("--device-memory", "260MiB"); !strings.Contains(out, "not even a row of one token") || !strings.Contains(out, "ZeRO stage") {
		t.Errorf("a 260 MiB device (4 MiB for the run): want the run-long terms named:\n%s", out)
	}
	// ZeRO-1 over 4 ranks: each holds a quarter of AdamW's moments.
	moments := func(out string) string {
		m := regexp.MustCompile(`(?m)^AdamW moments \(fp32 m, v\) +([0-9.]+ [KMG]iB)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no moments line:\n%s", out)
		}
		return m[1]
	}
	one, four := moments(plan()), plan("--world-size", "4", "--set", "train.zero=1")
	if got := moments(four); got == one || !strings.Contains(four, "4 ranks at ZeRO stage 1") {
		t.Errorf("ZeRO-1 over 4 ranks: moments %s (one process: %s):\n%s", got, one, four)
	}
	// Stages 2 and 3 shard the gradients, then the parameters.
	grads := func(out string) string {
		m := regexp.MustCompile(`(?m)^gradients \(fp32\) +([0-9.]+ [KMG]iB)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no gradients line:\n%s", out)
		}
		return m[1]
	}
	if s1, s2 := plan("--world-size", "4", "--zero", "1"), plan("--world-size", "4", "--zero", "2"); grads(s1) == grads(s2) || !strings.Contains(s2, "4 ranks at ZeRO stage 2") {
		t.Errorf("ZeRO 2 over 4 ranks: gradients %s (stage 1: %s):\n%s", grads(s2), grads(s1), s2)
	}
	// The checkpoints' size: sharded over the ranks at ZeRO 1-3 (a rank's
	// shard a quarter of the whole, rounded up), else the process's (or
	// rank 0's with checkpoint.layout gathered).
	ck := regexp.MustCompile(`checkpoints: ([0-9.]+ [KMG]iB) each, sharded \(checkpoint.layout auto or sharded\): ([0-9.]+ [KMG]iB) a rank's shard`)
	if m := ck.FindStringSubmatch(plan("--world-size", "4", "--zero", "2")); m == nil || !strings.Contains(plan(), "checkpoints: "+m[1]+" each, written by the process") {
		t.Errorf("the checkpoints' line: sharded %q; one process:\n%s", m, plan())
	}
	if out := plan("--world-size", "4", "--zero", "2", "--set", "checkpoint.layout=gathered"); !strings.Contains(out, "each, written by rank 0 from its host memory") {
		t.Errorf("checkpoint.layout gathered over 4 ranks: want rank 0 to write them:\n%s", out)
	}
	// fp32 activations (DISTILL_CUDA_ACT=f32) take more: the same device
	// then fits none of the modes.
	out = plan("--device-memory", "320MiB", "--set", "quant=nvfp4", "--activations", "f32")
	if !strings.Contains(out, "f32 activations") || regexp.MustCompile(`(?m)^full +[0-9.]+ MiB +yes `).MatchString(out) {
		t.Errorf("a 320 MiB device under QAD with fp32 activations: want full not fitting:\n%s", out)
	}
	run := filepath.Join(dir, "run") // a run's layout: no config.json at its top
	for _, step := range []string{"step-00000003", "step-00000007"} {
		os.MkdirAll(filepath.Join(run, "checkpoints", step), 0o755)
	}
	os.WriteFile(filepath.Join(run, "config.yaml"), []byte("run_dir: x\n"), 0o644)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--device-memory", "lots"}, "--device-memory"},
		// A number without a unit is bytes: 80 is a forgotten GiB, and a
		// device no larger than the reserve planned a negative budget.
		{[]string{"--device-memory", "80"}, `--device-memory: "80": a size without a unit is bytes, and 80 bytes is no device's memory: did you mean 80GiB?`},
		{[]string{"--device-memory", "200MiB"}, "--device-memory 200MiB: not more than the 256.0 MiB a device keeps in reserve: give the device's whole memory, e.g. 80GiB"},
		{[]string{"--set", "model.random=null", "--set", "model.init_from=" + filepath.Join(dir, "nomodel")}, "model.init_from: checkpoint directory " + filepath.Join(dir, "nomodel") + " does not exist (give the HF checkpoint's directory: the one holding config.json and model.safetensors): the plan reads only the student's config.json: point model.init_from at a directory that holds it, e.g. --set model.init_from=examples/model-configs/qwen3-8b"},
		// A run directory is not a checkpoint: its newest checkpoint is
		// (the advice was the example configs).
		{[]string{"--set", "model.random=null", "--set", "model.init_from=" + run}, "model.init_from: " + run + " is a student train run directory, not a checkpoint: point model.init_from at one of its checkpoints, e.g. " + filepath.Join(run, "checkpoints", "step-00000007")},
		{[]string{"--set", "train.recompute=most"}, "train.recompute"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"--activations", "fp16"}, "--activations"},
		{[]string{"--world-size", "0"}, "--world-size"},
		{[]string{"--zero", "4"}, "--zero"},
		{[]string{"--zero", "-1"}, "--zero -1: want 0, 1, 2 or 3"},
		{[]string{"--k", "-1"}, "--k -1: want >= 0"},
		// More top-k ids than the vocabulary holds was planned as given.
		{[]string{"--k", "1001"}, "--k 1001 is more than the vocabulary (1000, model.random.vocab_size): "},
		{[]string{"--k", "200000", "--set", "model.random=null", "--set", "model.init_from=" + filepath.Join("..", "..", "examples", "model-configs", "qwen3-8b")},
			"--k 200000 is more than the vocabulary (151936, the vocab_size of model.init_from's config.json): "},
		// One process holds the whole state: --zero was ignored without
		// a word.
		{[]string{"--zero", "3"}, "--zero 3 shards the optimizer state over data-parallel ranks: give their number too, --world-size N (N > 1)"},
	} {
		stdout = &bytes.Buffer{}
		err := runPlan(append([]string{"--config", cfg}, c.args...))
		stdout = os.Stdout
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %s", c.args, err, c.want)
		}
		if c.args[0] == "--k" && cli.ExitStatus(err) != 2 {
			t.Errorf("%v: exit status %d, want 2 (a usage error, as --k -1)", c.args, cli.ExitStatus(err))
		}
	}
	// The whole vocabulary is a top-k the plan takes.
	if out := plan("--k", "1000"); !strings.Contains(out, "teacher top-k 1000,") {
		t.Errorf("--k 1000, the vocabulary: %s", out)
	}
	if err := runPlan(nil); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Errorf("no --config: %v", err)
	}
	// The config's train.zero on one process: the plan says it is not
	// sharded, and how to plan the ranks.
	if out := plan("--set", "train.zero=2"); !strings.Contains(out, "bf16 activations, one process (train.zero 2 shards over data-parallel ranks: plan them with --world-size N)") {
		t.Errorf("train.zero 2 on one process: %s", out)
	}
	// --k 0 and --zero 0 given are numbers, not "the default".
	if out := plan("--k", "0", "--world-size", "2", "--zero", "0", "--set", "train.zero=1"); !strings.Contains(out, "teacher top-k 0,") || !strings.Contains(out, "2 ranks at ZeRO stage 0") {
		t.Errorf("--k 0 --zero 0: %s", out)
	}
}

// TestHelpNoSentinels: a flag whose default is another source's (the
// config's) says so in its help, not "(default -1)", and a flag's
// placeholder is a placeholder: `student train` in --config's help was
// taken for its name ("-config student train").
func TestHelpNoSentinels(t *testing.T) {
	for _, cmd := range []string{"init", "plan", "export", "plot", "train", "eval"} {
		c := exec.Command(os.Args[0], cmd, "-h")
		c.Env = append(os.Environ(), "STUDENT_TEST_MAIN=1")
		out, err := c.CombinedOutput()
		if err != nil {
			t.Fatalf("student %s -h: %v\n%s", cmd, err, out)
		}
		for _, bad := range []string{"(default -1)", "-config student train"} {
			if strings.Contains(string(out), bad) {
				t.Errorf("student %s -h says %q:\n%s", cmd, bad, out)
			}
		}
	}
}
