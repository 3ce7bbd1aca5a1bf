package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"distill/cache"
	"distill/data/tokenizer"
	"distill/model"
	"distill/train"
	"distill/train/testcache"
	"distill/train/trainer"
)

// TestMain runs the student command itself when STUDENT_TEST_MAIN=1, so
// that tests can start it as a real process (signals, exit codes).
func TestMain(m *testing.M) {
	if os.Getenv("STUDENT_TEST_MAIN") == "1" {
		commands.Main(os.Args[1:])
		return
	}
	os.Exit(m.Run())
}

// studentProc starts `student ARGS...` (this test binary) with its stderr
// read line by line into lines (closed at EOF) and kept in full.
type studentProc struct {
	cmd    *exec.Cmd
	lines  chan string
	stderr bytes.Buffer
}

func startStudent(t *testing.T, args ...string) *studentProc {
	t.Helper()
	p := &studentProc{cmd: exec.Command(os.Args[0], args...), lines: make(chan string, 1024)}
	p.cmd.Env = append(os.Environ(), "STUDENT_TEST_MAIN=1")
	r, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.cmd.Process.Kill() })
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			p.stderr.WriteString(sc.Text() + "\n")
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	return p
}

// waitLine waits for a stderr line containing s (no timeout: the process
// ending closes lines).
func (p *studentProc) waitLine(t *testing.T, s string) string {
	t.Helper()
	for l := range p.lines {
		if strings.Contains(l, s) {
			return l
		}
	}
	t.Fatalf("student ended without printing %q:\n%s", s, p.stderr.String())
	return ""
}

// wait drains stderr and returns the exit code.
func (p *studentProc) wait(t *testing.T) int {
	t.Helper()
	for range p.lines {
	}
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return p.cmd.ProcessState.ExitCode()
}

// sigCache builds in dir the tiny cache sigConfig's runs train on.
func sigCache(t *testing.T, dir string) *testcache.Built {
	t.Helper()
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 48, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const sigConfig = `run_dir: unused
seed: 4
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [nowhere], seq_len: 64, global_batch_tokens: 128, eval_range: [0, 8]}
optim: {lr: 3e-3, min_lr: 3e-4, lr_schedule: constant, warmup_steps: 1}
train: {max_steps: 1000000000, threads: 2}
eval: {every: 0}
checkpoint: {every: 0}
log: {every: 1, progress: "off"}
`

// TestSIGTERMCheckpointsAndResumes: `student train` sent SIGTERM (as a
// preempted cluster job is) writes a checkpoint of its last finished step
// and exits 0 (train.sigterm_exit_status's default: the scheduler
// requeues a preempted job), printing the command that resumes it; that
// command, run
// as printed (plus a --max-steps, since this run was set to never end),
// reproduces the uninterrupted run bit for bit. The run is endless until
// the signal, so the test does not depend on when the signal lands.
func TestSIGTERMCheckpointsAndResumes(t *testing.T) {
	dir := t.TempDir()
	b := sigCache(t, dir)
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(sigConfig), 0o644)
	run := filepath.Join(dir, "run dir") // a space: the printed command must quote it
	p := startStudent(t, "train", "--config", cfg, "--run-dir", run, "--cache", b.CacheDir)
	p.waitLine(t, "step 2/1000000000 ")
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	stoppedLine := p.waitLine(t, "stopped by SIGTERM after step ")
	defer func() { t.Logf("stderr of the stopped run:\n%s", p.stderr.String()) }()
	resumeLine := p.waitLine(t, "resume with: ")
	if rc := p.wait(t); rc != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0 (train.sigterm_exit_status's default):\n%s", rc, p.stderr.String())
	}
	k, err := strconv.Atoi(regexp.MustCompile(`after step (\d+) `).FindStringSubmatch(stoppedLine)[1])
	if err != nil || k < 2 {
		t.Fatalf("stopped line %q", stoppedLine)
	}
	ck := filepath.Join(run, "checkpoints", fmt.Sprintf("step-%08d", k))
	if got, _ := trainer.LatestCheckpoint(run); got != ck {
		t.Fatalf("stopped after step %d, newest checkpoint %q", k, got)
	}
	// Its weights are the F32 masters, and its config.json says so:
	// transformers' torch_dtype="auto" would round them to BF16 otherwise.
	var cj struct {
		DType string `json:"torch_dtype"`
	}
	if b, err := os.ReadFile(filepath.Join(ck, "config.json")); err != nil || json.Unmarshal(b, &cj) != nil || cj.DType != "float32" {
		t.Fatalf("%s/config.json: torch_dtype %q (%v), want float32", ck, cj.DType, err)
	}
	if h, err := os.ReadFile(filepath.Join(ck, "model.safetensors")); err != nil || !bytes.Contains(h[:min(len(h), 4096)], []byte(`"dtype":"F32"`)) || bytes.Contains(h[:min(len(h), 4096)], []byte(`"dtype":"BF16"`)) {
		t.Fatalf("%s/model.safetensors: want F32 tensors only (%v)", ck, err)
	}
	cmdline := strings.TrimPrefix(resumeLine, "resume with: ")
	if !strings.HasPrefix(cmdline, os.Args[0]+" train ") || !strings.Contains(cmdline, "'"+run+"'") {
		t.Fatalf("resume command %q", cmdline)
	}
	last := k + 2
	sh := exec.Command("sh", "-c", fmt.Sprintf("%s --max-steps %d", cmdline, last))
	sh.Env = append(os.Environ(), "STUDENT_TEST_MAIN=1")
	if out, err := sh.CombinedOutput(); err != nil || !strings.Contains(string(out), fmt.Sprintf("resumed from %s", filepath.Join(run, "checkpoints", fmt.Sprintf("step-%08d", k)))) {
		t.Fatalf("resume command: %v\n%s", err, out)
	}

	straight := filepath.Join(dir, "straight")
	c, err := trainer.LoadConfig(cfg, []string{"run_dir=" + straight, "data.cache=[" + b.CacheDir + "]", fmt.Sprintf("train.max_steps=%d", last)})
	if err != nil {
		t.Fatal(err)
	}
	full, err := trainer.Run(c, trainer.Options{Log: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	x, _ := os.ReadFile(filepath.Join(full.Checkpoint, "model.safetensors"))
	y, _ := os.ReadFile(filepath.Join(run, "checkpoints", fmt.Sprintf("step-%08d", last), "model.safetensors"))
	if len(x) == 0 || !bytes.Equal(x, y) {
		t.Fatalf("weights after SIGTERM at step %d and resume to %d differ from the uninterrupted run's", k, last)
	}
	a, b2 := trainLosses(t, straight), trainLosses(t, run)
	if len(a) != last || len(b2) != last {
		t.Fatalf("metrics.jsonl: %d and %d steps, want %d", len(a), len(b2), last)
	}
	for i := range a {
		if a[i] != b2[i] {
			t.Fatalf("step %d loss %v, uninterrupted %v", i+1, b2[i], a[i])
		}
	}
}

// TestStopExitStatus: the exit status of a run a signal stopped after
// its checkpoint: Ctrl-C (SIGINT) exits 130 whatever the config says;
// SIGTERM exits train.sigterm_exit_status, 143 (128+SIGTERM) when set so
// for a scheduler that restarts only failed jobs. (Its default, 0, is
// TestSIGTERMCheckpointsAndResumes's.)
func TestStopExitStatus(t *testing.T) {
	dir := t.TempDir()
	b := sigCache(t, dir)
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(sigConfig), 0o644)
	for i, c := range []struct {
		sig  syscall.Signal
		sets []string
		want int
	}{
		{syscall.SIGINT, nil, 130},
		{syscall.SIGINT, []string{"--set", "train.sigterm_exit_status=0"}, 130},
		{syscall.SIGTERM, []string{"--set", "train.sigterm_exit_status=143"}, 143},
	} {
		run := filepath.Join(dir, fmt.Sprintf("run%d", i))
		p := startStudent(t, append([]string{"train", "--config", cfg, "--run-dir", run, "--cache", b.CacheDir}, c.sets...)...)
		p.waitLine(t, "step 1/1000000000 ")
		if err := p.cmd.Process.Signal(c.sig); err != nil {
			t.Fatal(err)
		}
		p.waitLine(t, "stopped by "+sigName(c.sig)+" after step ")
		if rc := p.wait(t); rc != c.want {
			t.Errorf("%s with %q: exit code %d, want %d:\n%s", sigName(c.sig), c.sets, rc, c.want, p.stderr.String())
		}
		if ck, _ := trainer.LatestCheckpoint(run); ck == "" {
			t.Errorf("%s with %q: no checkpoint in %s", sigName(c.sig), c.sets, run)
		}
	}
	// Any other status is refused before the run starts.
	p := startStudent(t, "train", "--config", cfg, "--run-dir", filepath.Join(dir, "bad"), "--cache", b.CacheDir, "--set", "train.sigterm_exit_status=1")
	l := p.waitLine(t, "train.sigterm_exit_status")
	if rc := p.wait(t); rc != 1 || !strings.Contains(l, "want 0") || !strings.Contains(l, "or 143") {
		t.Errorf("train.sigterm_exit_status=1: exit code %d, %q", rc, l)
	}
}

func trainLosses(t *testing.T, runDir string) []float64 {
	t.Helper()
	f, err := os.ReadFile(filepath.Join(runDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var out []float64
	for _, line := range bytes.Split(bytes.TrimSpace(f), []byte("\n")) {
		var l struct {
			Type string  `json:"type"`
			Loss float64 `json:"loss"`
		}
		if err := json.Unmarshal(line, &l); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		if l.Type == "train" {
			out = append(out, l.Loss)
		}
	}
	return out
}

// TestSecondSignalExitsAtOnce: a second signal ends `student train` at
// once, even while it is stuck (here: reading its config from a FIFO no
// one writes), with 128+SIGTERM and no checkpoint. The parent knows the
// handler is in place when its open of the FIFO returns: the child opens
// it after installing the handler.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "config.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	run := filepath.Join(dir, "run")
	p := startStudent(t, "train", "--config", fifo, "--run-dir", run)
	w, err := os.OpenFile(fifo, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	p.cmd.Process.Signal(syscall.SIGTERM)
	p.waitLine(t, "send it again to exit at once")
	p.cmd.Process.Signal(syscall.SIGTERM)
	p.waitLine(t, "second SIGTERM: exiting now")
	if rc := p.wait(t); rc != 128+int(syscall.SIGTERM) {
		t.Fatalf("exit code %d, want %d:\n%s", rc, 128+int(syscall.SIGTERM), p.stderr.String())
	}
	if _, err := os.Stat(filepath.Join(run, "checkpoints")); !os.IsNotExist(err) {
		t.Fatalf("a checkpoint directory appeared: %v", err)
	}
}

// TestBadNumbersAreErrors: numbers the commands used to ignore silently
// are errors naming the flag or key.
func TestBadNumbersAreErrors(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(sigConfig), 0o644)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--config", cfg, "--max-steps", "-5"}, "train.max_steps"},
		{[]string{"--config", cfg, "--max-steps", "0"}, "train.max_steps"},
		{[]string{"--config", cfg, "--threads", "-1"}, "train.threads"},
		{[]string{"--config", cfg, "--set", "train.max_steps=40.5"}, "train.max_steps"},
	} {
		if err := runTrain(c.args); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("train %v: %v", c.args, err)
		}
	}
	out := filepath.Join(dir, "init")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--vocab", "0", "--hidden", "-5"}, "--vocab 0"},
		{[]string{"--hidden", "-5"}, "--hidden -5"},
		{[]string{"--layers", "0"}, "--layers 0"},
		{[]string{"--std", "0"}, "--std"},
		{[]string{"--dtype", "f16"}, "--dtype"},
	} {
		if err := runInit(append([]string{"--out", out}, c.args...)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("init %v: %v", c.args, err)
		}
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Fatalf("a refused init wrote %s", out)
	}
}

// TestInitExportReplaceWhole: init and export refuse a non-empty --out
// unless --force, and with --force the directory holds only the new
// files: a stale model.safetensors.index.json (which the loader prefers,
// so it loaded the OLD weights) is gone. export ships the run's tokenizer
// files and generation_config.json.
func TestInitExportReplaceWhole(t *testing.T) {
	dir := t.TempDir()
	tokDir := filepath.Join(dir, "tok")
	os.MkdirAll(tokDir, 0o755)
	writeByteTokenizer(t, tokDir)
	os.WriteFile(filepath.Join(tokDir, "tokenizer_config.json"), []byte(`{"eos_token": "b"}`), 0o644)
	os.WriteFile(filepath.Join(tokDir, "generation_config.json"), []byte(`{"do_sample": false}`), 0o644)
	tk, err := tokenizer.Load(tokDir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := testcache.Build(testcache.Options{Dir: dir, Vocab: 97, K: 8, Samples: 32, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 2, TokenizerFingerprint: tk.Fingerprint()})
	if err != nil {
		t.Fatal(err)
	}

	// init: a second init into the same directory is refused, then forced.
	initDir := filepath.Join(dir, "init")
	base := []string{"--out", initDir, "--vocab", "97", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-pos", "128"}
	if err := runInit(base); err != nil {
		t.Fatal(err)
	}
	if err := runInit(append(base, "--seed", "2")); !errors.Is(err, model.ErrNotEmpty) || !strings.Contains(err.Error(), "--force") || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("init into a non-empty dir: %v", err)
	}
	os.WriteFile(filepath.Join(initDir, "stale.txt"), []byte("x"), 0o644)
	if err := runInit(append(base, "--seed", "2", "--force")); err != nil {
		t.Fatal(err)
	}
	if names := dirNames(t, initDir); strings.Join(names, " ") != "config.json model.safetensors" {
		t.Fatalf("forced init left %v", names)
	}

	// Train from the init directory with model.tokenizer.
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf(`run_dir: %s
model: {init_from: %s, tokenizer: %s}
data: {cache: [%s], seq_len: 64, global_batch_tokens: 128}
optim: {lr: 3e-3, min_lr: 3e-4, warmup_steps: 1}
train: {max_steps: 3, threads: 2}
log: {progress: "off"}
`, filepath.Join(dir, "run"), initDir, tokDir, b.CacheDir)), 0o644)
	if err := runTrain([]string{"--config", cfg}); err != nil {
		t.Fatal(err)
	}

	// An old export, sharded: its index names shards the new one lacks.
	out := filepath.Join(dir, "export")
	os.MkdirAll(out, 0o755)
	old, err := train.LoadHF(initDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.WriteHF(out, "BF16"); err != nil {
		t.Fatal(err)
	}
	os.Rename(filepath.Join(out, "model.safetensors"), filepath.Join(out, "model-00001-of-00001.safetensors"))
	idx := map[string]any{"metadata": map[string]any{}, "weight_map": map[string]string{}}
	for _, ts := range old.Tensors {
		idx["weight_map"].(map[string]string)[ts.Name] = "model-00001-of-00001.safetensors"
	}
	ib, _ := json.Marshal(idx)
	os.WriteFile(filepath.Join(out, "model.safetensors.index.json"), ib, 0o644)

	run := filepath.Join(dir, "run")
	if err := runExport([]string{"--checkpoint", run, "--out", out}); !errors.Is(err, model.ErrNotEmpty) {
		t.Fatalf("export into a non-empty dir: %v", err)
	}
	if err := runExport([]string{"--checkpoint", run, "--out", out, "--force"}); err != nil {
		t.Fatal(err)
	}
	want := "config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json"
	if names := dirNames(t, out); strings.Join(names, " ") != want {
		t.Fatalf("export dir holds %v, want %s", names, want)
	}
	got, err := train.LoadHF(out)
	if err != nil {
		t.Fatal(err)
	}
	trained, _, err := trainer.LoadStudent(run)
	if err != nil {
		t.Fatal(err)
	}
	name := "model.embed_tokens.weight"
	gw, tw, ow := got.Weights()[name], trained.Weights()[name], old.Weights()[name]
	same := func(a, b []float32) bool { // equal up to BF16 rounding
		for i := range a {
			if d := float64(a[i] - b[i]); math.Abs(d) > math.Abs(float64(b[i]))/128+1e-9 {
				return false
			}
		}
		return true
	}
	if !same(gw, tw) || same(gw, ow) {
		t.Fatalf("the export does not load the trained weights of %s", name)
	}
	if tkb, _ := tokenizer.Load(out); tkb == nil || tkb.Fingerprint() != tk.Fingerprint() {
		t.Fatal("the export's tokenizer is not the run's")
	}
	// The tokenizer changed since training: exporting it would ship the
	// wrong one.
	os.WriteFile(filepath.Join(tokDir, "tokenizer_config.json"), []byte(`{"eos_token": "a"}`), 0o644)
	if err := runExport([]string{"--checkpoint", run, "--out", filepath.Join(dir, "e2")}); err == nil || !strings.Contains(err.Error(), "--no-tokenizer") {
		t.Fatalf("export with a changed tokenizer: %v", err)
	}
	if err := runExport([]string{"--checkpoint", run, "--out", filepath.Join(dir, "e2"), "--no-tokenizer"}); err != nil {
		t.Fatal(err)
	}
	if names := dirNames(t, filepath.Join(dir, "e2")); strings.Join(names, " ") != "config.json model.safetensors" {
		t.Fatalf("--no-tokenizer export holds %v", names)
	}
	// --force onto the cache or another run (a mistyped --out) removed
	// it and exited 0: refused, naming what it is, nothing removed.
	other := filepath.Join(dir, "run2") // another run's layout
	os.MkdirAll(filepath.Join(other, "checkpoints", "step-00000002"), 0o755)
	os.WriteFile(filepath.Join(other, "metrics.jsonl"), []byte("{}\n"), 0o644)
	for _, c := range []struct{ out, what string }{
		{b.CacheDir, "is a teacher cache"},
		{other, "is a student train run directory"},
	} {
		before := strings.Join(dirNames(t, c.out), " ")
		for _, args := range [][]string{
			{"export", "--checkpoint", run, "--out", c.out, "--force", "--no-tokenizer"},
			{"init", "--out", c.out, "--force", "--vocab", "97", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--intermediate", "64", "--max-pos", "128"},
		} {
			cmd := runExport
			if args[0] == "init" {
				cmd = runInit
			}
			err := cmd(args[1:])
			if !errors.Is(err, model.ErrNotReplaceable) || !strings.Contains(err.Error(), c.out+" "+c.what) || !strings.Contains(err.Error(), "nothing was removed") {
				t.Errorf("student %s: %v, want a refusal saying %s %s", strings.Join(args, " "), err, c.out, c.what)
			}
		}
		if after := strings.Join(dirNames(t, c.out), " "); after != before {
			t.Errorf("%s holds %q after the refused --force, was %q", c.out, after, before)
		}
	}
	if _, err := cache.OpenReader(b.CacheDir); err != nil {
		t.Errorf("the cache after the refused exports: %v", err)
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// writeByteTokenizer writes a byte-level BPE tokenizer.json of the 256
// byte tokens (GPT-2's byte-to-unicode map) and one merge.
func writeByteTokenizer(t *testing.T, dir string) {
	t.Helper()
	vocab := map[string]int{}
	n := 0
	for b := 0; b < 256; b++ {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE && b <= 0xFF) {
			r = rune(256 + n)
			n++
		}
		vocab[string(r)] = b
	}
	vocab["ab"] = 256
	js, _ := json.Marshal(map[string]any{
		"model":         map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{"a b"}},
		"pre_tokenizer": map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
		"decoder":       map[string]any{"type": "ByteLevel"},
	})
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
}
