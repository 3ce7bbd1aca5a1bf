package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"

	"distill/compute/cuda/cudaemu"
)

// TestLoRACLI is a LoRA student's user flow through the command, on two
// emulated GPUs: `student train --nproc-per-node 2` (train.device cuda,
// every module adapted, lora_dropout) stopped by SIGTERM exits 0 and
// prints a resume command that is the job's, --nproc-per-node included
// (each rank printed its own command line, which a user running it got
// one process from); that command resumes both ranks; `student export`
// writes the adapters as PEFT does (--format peft) and the merged model
// (--format bf16); `student eval` scores the run and the merged export
// alike.
func TestLoRACLI(t *testing.T) {
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
	dir := t.TempDir()
	b := sigCache(t, filepath.Join(dir, "cache"))
	conf := strings.Replace(sigConfig, "threads: 2}", "threads: 1, device: cuda}", 1)
	conf = strings.Replace(conf, "  tokenizer_fingerprint: testcache-tokenizer\n", "  tokenizer_fingerprint: testcache-tokenizer\n"+
		"  lora: {rank: 4, alpha: 8, dropout: 0.1, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}\n", 1)
	cfg := filepath.Join(dir, "run.yaml")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(dir, "run")
	p := startStudent(t, "train", "--config", cfg, "--run-dir", run, "--cache", b.CacheDir, "--nproc-per-node", "2")
	p.waitLine(t, "[rank 0] step 2/1000000000 ")
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if rc := p.wait(t); rc != 0 {
		t.Fatalf("exit status %d after SIGTERM, want 0:\n%s", rc, p.stderr.String())
	}
	m := regexp.MustCompile(`\[rank 0\] resume with: (.*)`).FindStringSubmatch(p.stderr.String())
	if m == nil {
		t.Fatalf("no resume command:\n%s", p.stderr.String())
	}
	if !strings.Contains(m[1], "--nproc-per-node 2") {
		t.Fatalf("the resume command %q is not the job's: it has no --nproc-per-node 2", m[1])
	}
	// The stop lands at a step boundary after the signal: step 2 or a
	// later one on a loaded machine. The resume runs 3 steps past it.
	cks, err := filepath.Glob(filepath.Join(run, "checkpoints", "step-*"))
	if err != nil || len(cks) == 0 {
		t.Fatalf("no checkpoint after SIGTERM (%v):\n%s", err, p.stderr.String())
	}
	sort.Strings(cks)
	var stopped int
	if _, err := fmt.Sscanf(filepath.Base(cks[len(cks)-1]), "step-%d", &stopped); err != nil {
		t.Fatal(err)
	}
	target := stopped + 3
	sh := exec.Command("sh", "-c", fmt.Sprintf("%s --max-steps %d", m[1], target))
	sh.Env = append(os.Environ(), "STUDENT_TEST_MAIN=1")
	out, err := sh.CombinedOutput()
	if done := fmt.Sprintf("[rank 0] done: step %d", target); err != nil || !strings.Contains(string(out), "[rank 1] resumed from ") || !strings.Contains(string(out), done) {
		t.Fatalf("the printed resume command: %v, want both ranks resumed from step %d and %q:\n%s", err, stopped, done, out)
	}
	ck := filepath.Join(run, "checkpoints", fmt.Sprintf("step-%08d", target))
	for _, f := range []string{"adapter_config.json", "adapter_model.safetensors"} {
		if _, err := os.Stat(filepath.Join(ck, f)); err != nil {
			t.Fatalf("the LoRA checkpoint: %v", err)
		}
	}

	for format, files := range map[string][]string{"peft": {"adapter_config.json", "adapter_model.safetensors"}, "bf16": {"config.json", "model.safetensors"}} {
		outDir := filepath.Join(dir, format)
		p := startStudent(t, "export", "--checkpoint", run, "--out", outDir, "--format", format)
		if rc := p.wait(t); rc != 0 {
			t.Fatalf("export --format %s: exit status %d:\n%s", format, rc, p.stderr.String())
		}
		for _, f := range files {
			if _, err := os.Stat(filepath.Join(outDir, f)); err != nil {
				t.Fatalf("export --format %s: %v\n%s", format, err, p.stderr.String())
			}
		}
	}
	eval := func(args ...string) float64 {
		t.Helper()
		c := exec.Command(os.Args[0], append([]string{"eval", "--cache", b.CacheDir, "--range", "0:8", "--json"}, args...)...)
		c.Env = append(os.Environ(), "STUDENT_TEST_MAIN=1")
		var stderr strings.Builder
		c.Stderr = &stderr
		out, err := c.Output()
		var m struct{ CE float64 }
		if err != nil || json.Unmarshal(out, &m) != nil {
			t.Fatalf("eval %v: %v\n%s%s", args, err, out, stderr.String())
		}
		return m.CE
	}
	ce, mce := eval("--checkpoint", run), eval("--checkpoint", filepath.Join(dir, "bf16"), "--tokenizer-fingerprint", "testcache-tokenizer")
	if !(ce > 0) || math.Abs(ce-mce) > 1e-2*ce {
		t.Errorf("eval: the run's CE %v, its merged BF16 export's %v: want them within 1%%", ce, mce)
	}
}
