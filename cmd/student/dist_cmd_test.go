package main

import (
	"bytes"
	"distill/compute/cuda/cudaemu"
	"distill/train/testcache"
	"distill/train/trainer"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

func TestWithoutFlag(t *testing.T) {
	cases := []struct{ in, want []string }{
		{[]string{"--config", "c", "--nproc-per-node", "2", "--set", "a=1"}, []string{"--config", "c", "--set", "a=1"}},
		{[]string{"-nproc-per-node=4", "--config", "c"}, []string{"--config", "c"}},
		{[]string{"--nproc-per-node=4"}, nil},
		{[]string{"--config", "c", "--", "--nproc-per-node", "2"}, []string{"--config", "c", "--", "--nproc-per-node", "2"}},
		{[]string{"--nproc-per-node-x", "1"}, []string{"--nproc-per-node-x", "1"}},
	}
	for _, c := range cases {
		if got := withoutFlag(c.in, "nproc-per-node"); !reflect.DeepEqual(got, c.want) {
			t.Errorf("withoutFlag(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestTrainNProcPerNode: `student train --nproc-per-node 2` starts two
// ranks of this binary, prefixed in its output; on the CPU, which has no
// collectives, each rank stops saying that data-parallel training needs
// train.device cuda (NCCL), and the job fails naming a rank. The error
// names the device setting in effect: an unset train.device is auto, the
// default (it said train.device ""), here with no CUDA driver to open.
// (On the CUDA emulator, with its NCCL stand-in, the ranks train: package
// trainer's TestCUDADataParallel.)
func TestTrainNProcPerNode(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "cache"), Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(dir, "libcuda.so.1")) // auto: the CPU, on a GPU's machine too
	for _, tc := range []struct{ device, said string }{
		{", device: cpu", "train.device cpu opened the cpu backend"},
		{"", "train.device auto (the default) opened the cpu backend"},
	} {
		cfg := filepath.Join(dir, "run.yaml")
		os.WriteFile(cfg, []byte(`run_dir: `+filepath.Join(dir, "run")+`
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [`+b.CacheDir+`], seq_len: 64, global_batch_tokens: 128}
train: {max_steps: 2, threads: 1`+tc.device+`}
log: {progress: "off"}
`), 0o644)
		// On the CPU there are no collectives: each rank says what to set.
		p := startStudent(t, "train", "--config", cfg, "--nproc-per-node", "2")
		if code := p.wait(t); code != 1 {
			t.Fatalf("exit status %d, want 1; stderr:\n%s", code, p.stderr.String())
		}
		out := p.stderr.String()
		for _, want := range []string{
			"[rank 0] student train: rank 0 of 2",
			"[rank 1] student train: rank 1 of 2",
			"data-parallel training runs on GPUs through NCCL, and " + tc.said + ", which has no collectives",
			"set train.device: cuda",
			"exited with status 1",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("stderr lacks %q:\n%s", want, out)
			}
		}
	}
}

// TestSIGTERMOneRankStopsTheJob: SIGTERM to one rank of a data-parallel
// job (a scheduler preempting one node) stops every rank after the same
// step; rank 0 writes the job's checkpoint, every rank exits 0
// (train.sigterm_exit_status's default), and so does the launcher; rank
// 0 alone prints the resume command. The
// ranks run on the CUDA emulator, two emulated GPUs and its NCCL
// stand-in; the signal goes to rank 1 alone, found among the launcher's
// children by its RANK. First, the same job run to its end exits 0 on
// every rank, five times (a rank closing the control plane as soon as
// its run returned made the others' watchers exit 1 at times).
func TestSIGTERMOneRankStopsTheJob(t *testing.T) {
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
	dir := t.TempDir()
	b := sigCache(t, filepath.Join(dir, "cache"))
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(strings.Replace(sigConfig, "threads: 2}", "threads: 1, device: cuda}", 1)), 0o644)
	for i := range 5 {
		p := startStudent(t, "train", "--config", cfg, "--run-dir", filepath.Join(dir, fmt.Sprint("done", i)), "--cache", b.CacheDir, "--nproc-per-node", "2", "--max-steps", "2")
		if rc := p.wait(t); rc != 0 {
			t.Fatalf("run %d to its end: exit status %d, want 0:\n%s", i, rc, p.stderr.String())
		}
	}
	run := filepath.Join(dir, "run")
	p := startStudent(t, "train", "--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--nproc-per-node", "2")
	p.waitLine(t, "[rank 0] step 2/1000000000 ")
	rank1 := 0
	for _, pid := range childPIDs(t, p.cmd.Process.Pid) {
		env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		for _, kv := range bytes.Split(env, []byte{0}) {
			if string(kv) == "RANK=1" {
				rank1 = pid
			}
		}
	}
	if rank1 == 0 {
		t.Fatalf("no child of the launcher (pid %d) has RANK=1", p.cmd.Process.Pid)
	}
	if err := syscall.Kill(rank1, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if rc := p.wait(t); rc != 0 {
		t.Fatalf("exit status %d after SIGTERM to rank 1, want 0:\n%s", rc, p.stderr.String())
	}
	out := p.stderr.String()
	m0 := regexp.MustCompile(`\[rank 0\] student train: stopped by a stop on another rank after step (\d+) `).FindStringSubmatch(out)
	m1 := regexp.MustCompile(`\[rank 1\] student train: stopped by SIGTERM after step (\d+) `).FindStringSubmatch(out)
	if m0 == nil || m1 == nil || m0[1] != m1[1] {
		t.Fatalf("want both ranks stopped after the same step, rank 0 by the other's stop and rank 1 by SIGTERM:\n%s", out)
	}
	k, _ := strconv.Atoi(m0[1])
	if ck, _ := trainer.LatestCheckpoint(run); ck != filepath.Join(run, "checkpoints", fmt.Sprintf("step-%08d", k)) {
		t.Fatalf("stopped after step %d, newest checkpoint %q:\n%s", k, ck, out)
	}
	if strings.Contains(out, "exited with status") {
		t.Fatalf("the launcher reports a rank's failure:\n%s", out)
	}
	// The job's resume command once, from rank 0; rank 1 says it stopped
	// with the others. Every rank printed "resume with: ...".
	if strings.Count(out, "resume with: ") != 1 || !strings.Contains(out, "[rank 0] resume with: ") ||
		!strings.Contains(out, fmt.Sprintf("[rank 1] student train: stopped by SIGTERM after step %d of 1000000000 with the other ranks; rank 0 says how to resume\n", k)) {
		t.Errorf("want the resume command from rank 0 alone:\n%s", out)
	}
}

// childPIDs lists pid's children (/proc/PID/task/TID/children).
func childPIDs(t *testing.T, pid int) []int {
	t.Helper()
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		if err != nil {
			t.Fatalf("the launcher's children: %v", err)
		}
		for _, f := range strings.Fields(string(b)) {
			n, _ := strconv.Atoi(f)
			out = append(out, n)
		}
	}
	return out
}

// TestDataParallelCLI: the commands of a sharded data-parallel job, as a
// user runs them, on the CUDA emulator (three emulated GPUs and its NCCL
// stand-in): `student train --nproc-per-node 2` at ZeRO 3 writes sharded
// checkpoints; the same command with --nproc-per-node 3 resumes them at
// another world size; `student export` builds the HF checkpoint from the
// last sharded one; `student eval` scores it. Each exits 0. (The numerics
// of resharding are package trainer's tests; this is the glue of the
// commands around them.)
func TestDataParallelCLI(t *testing.T) {
	cudaemu.UseDevices(t, 3, "three GPUs: emulated only")
	dir := t.TempDir()
	b := sigCache(t, filepath.Join(dir, "cache"))
	cfg := filepath.Join(dir, "run.yaml")
	conf := strings.Replace(sigConfig, "threads: 2}", "threads: 1, device: cuda, zero: 3}", 1)
	conf = strings.Replace(conf, "checkpoint: {every: 0}", "checkpoint: {every: 2, layout: sharded}", 1)
	os.WriteFile(cfg, []byte(conf), 0o644)
	run := filepath.Join(dir, "run")
	step := func(nproc, steps int) string {
		t.Helper()
		p := startStudent(t, "train", "--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--nproc-per-node", fmt.Sprint(nproc), "--max-steps", fmt.Sprint(steps))
		if rc := p.wait(t); rc != 0 {
			t.Fatalf("%d ranks to step %d: exit status %d:\n%s", nproc, steps, rc, p.stderr.String())
		}
		return p.stderr.String()
	}
	step(2, 2)
	ck2 := filepath.Join(run, "checkpoints", "step-00000002")
	if _, err := os.Stat(filepath.Join(ck2, "model.safetensors")); err == nil {
		t.Fatalf("%s holds a gathered model.safetensors: want a sharded checkpoint", ck2)
	}
	out := step(3, 4)
	if !strings.Contains(out, "resumed from "+ck2) {
		t.Fatalf("3 ranks did not resume from %s:\n%s", ck2, out)
	}
	hf := filepath.Join(dir, "hf")
	p := startStudent(t, "export", "--checkpoint", run, "--out", hf, "--format", "bf16", "--no-tokenizer")
	if rc := p.wait(t); rc != 0 {
		t.Fatalf("export: exit status %d:\n%s", rc, p.stderr.String())
	}
	for _, f := range []string{"config.json", "model.safetensors"} {
		if _, err := os.Stat(filepath.Join(hf, f)); err != nil {
			t.Fatalf("export: %v\n%s", err, p.stderr.String())
		}
	}
	p = startStudent(t, "eval", "--checkpoint", run, "--cache", b.CacheDir, "--range", "0:8")
	if rc := p.wait(t); rc != 0 {
		t.Fatalf("eval: exit status %d:\n%s", rc, p.stderr.String())
	}
}
