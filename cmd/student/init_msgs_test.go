package main

import (
	"bytes"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/internal/cli"
)

// TestInitMessages: an unknown --arch lists the valid ones, and -h shows
// each default once (no "(default -1)" after a flag whose default the
// text gives).
func TestInitMessages(t *testing.T) {
	err := runInit([]string{"--arch", "gpt2", "--out", filepath.Join(t.TempDir(), "m")})
	if err == nil || !strings.Contains(err.Error(), `"gpt2": want llama, qwen2, qwen3 or qwen3_moe`) {
		t.Errorf("--arch gpt2: %v", err)
	}
	var help bytes.Buffer
	initUsage = &help
	err = runInit([]string{"-h"})
	initUsage = os.Stderr
	if err != flag.ErrHelp {
		t.Fatalf("-h: %v", err)
	}
	for _, line := range strings.Split(help.String(), "\n") {
		if strings.Count(line, "(default") > 1 {
			t.Errorf("-h: %q gives its default twice", line)
		}
	}
	if !strings.Contains(help.String(), "router_aux_loss_coef") {
		t.Errorf("-h output %q", help.String())
	}
	if err := runInit([]string{"--arch", "qwen3_moe", "--router-aux-loss-coef", "x", "--out", filepath.Join(t.TempDir(), "m")}); err == nil || !strings.Contains(err.Error(), "--router-aux-loss-coef x: want a number >= 0") {
		t.Errorf("--router-aux-loss-coef x: %v", err)
	}
}

// TestInitRefusesWhatCannotBeMade: sizes this machine cannot hold or
// store are refused before anything is allocated or written, naming the
// model and the flags to check (a mistyped --vocab ended in Go's "fatal
// error: out of memory" and a stack trace); qwen2 with --attention-bias
// false, which wrote a checkpoint without the q/k/v biases every loader
// wants, is a usage error; --std says what it wants.
func TestInitRefusesWhatCannotBeMade(t *testing.T) {
	mem, disk := hostMemAvailable, diskFree
	t.Cleanup(func() { hostMemAvailable, diskFree = mem, disk })
	hostMemAvailable = func() (memAvail, bool) { return memAvail{bytes: 1 << 30}, true }
	diskFree = func(string) (int64, bool) { return 0, false }
	out := filepath.Join(t.TempDir(), "sub", "m")
	err := runInit([]string{"--out", out, "--vocab", "100000000", "--hidden", "64"})
	if err == nil || cli.ExitStatus(err) != 1 || !strings.Contains(err.Error(), "a qwen3 of 12.80B parameters") ||
		!strings.Contains(err.Error(), "of memory, and this machine has 1.0 GiB available: check the size flags (--vocab") {
		t.Errorf("init of 12.8B parameters on 1 GiB: %v", err)
	}
	hostMemAvailable = func() (memAvail, bool) { return memAvail{}, false }
	diskFree = func(string) (int64, bool) { return 1 << 20, true }
	err = runInit([]string{"--out", out, "--vocab", "100000", "--hidden", "64"})
	if err == nil || !strings.Contains(err.Error(), "its BF16 checkpoint takes 24.6 MiB, and the file system of "+filepath.Dir(filepath.Dir(out))+" has 1.0 MiB free") {
		t.Errorf("init of 24.6 MiB on a disk with 1 MiB free: %v", err)
	}
	if _, err := os.Stat(filepath.Dir(out)); !os.IsNotExist(err) {
		t.Errorf("a refused init made %s", filepath.Dir(out))
	}
	diskFree = func(string) (int64, bool) { return 0, false }
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--arch", "qwen2", "--attention-bias", "false"}, "--attention-bias false: qwen2 always has q/k/v biases"},
		{[]string{"--std", "-1"}, "--std -1: want a positive standard deviation"},
		{[]string{"--std", "NaN"}, "--std NaN: want a positive standard deviation"},
		// Head counts name the flags, and a value the preset set says so:
		// the parser's "num_attention_heads 3 is not a multiple of
		// num_key_value_heads 2" named a value never typed.
		{[]string{"--heads", "3"}, "--heads 3 is not a multiple of --kv-heads 2 (the preset's): each key/value head serves the same number of query heads; give --kv-heads a divisor of 3 (e.g. --kv-heads 1), or --heads a multiple of 2"},
		{[]string{"--kv-heads", "3"}, "--heads 4 (the preset's) is not a multiple of --kv-heads 3"},
		// It said "head_dim 7 must be positive and even (RoPE rotates pairs)".
		{[]string{"--arch", "llama", "--hidden", "30"}, "--hidden 30 is not divisible by --heads 4 (the preset's): llama derives head_dim = hidden/heads"},
		// The parser's errors named config.json keys ("head_dim 7 must be
		// positive and even", "mlp_only_layers entry 5 outside [0,2)"),
		// not the flags typed.
		{[]string{"--head-dim", "7"}, "--head-dim 7 must be positive and even (RoPE rotates pairs)"},
		{[]string{"--arch", "llama", "--hidden", "28"}, "--hidden 28 / --heads 4 (the preset's) gives head_dim 7, which must be positive and even (RoPE rotates pairs)"},
		{[]string{"--arch", "qwen3_moe", "--layers", "2", "--mlp-only-layers", "5"}, "--mlp-only-layers entry 5 outside [0,2)"},
		{[]string{"--arch", "qwen3_moe", "--experts", "2", "--experts-per-tok", "4"}, "--experts-per-tok 4 exceeds --experts 2"},
		// A qwen3_moe checkpoint with no sparse layer was written, exit 0.
		{[]string{"--arch", "qwen3_moe", "--layers", "3", "--decoder-sparse-step", "9"}, "qwen3_moe with no sparse layer: with --decoder-sparse-step 9 and --mlp-only-layers 1, none of the 3 layers has experts"},
		{[]string{"--arch", "qwen3_moe", "--layers", "2", "--mlp-only-layers", "0,1"}, "give a --decoder-sparse-step of at most 2, or fewer --mlp-only-layers"},
	} {
		err := runInit(append(c.args, "--out", out))
		if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), c.want) {
			t.Errorf("init %v: %v; want a usage error saying %q", c.args, err, c.want)
		}
	}
	var summary bytes.Buffer
	initOut = &summary
	t.Cleanup(func() { initOut = os.Stdout })
	if err := runInit([]string{"--arch", "qwen2", "--attention-bias", "true", "--layers", "1", "--out", out}); err != nil {
		t.Errorf("qwen2 --attention-bias true (what qwen2 is): %v", err)
	}
	if want := "wrote " + out + ": qwen2, 1 layer, hidden 64"; !strings.HasPrefix(summary.String(), want) {
		t.Errorf("init printed %q, want %q...", summary.String(), want)
	}
}

// TestInitRefusesOutInsideModel: --out m1/sub, m1 a model directory, wrote
// a model nested inside m1 (exit 0).
func TestInitRefusesOutInsideModel(t *testing.T) {
	initOut = io.Discard
	t.Cleanup(func() { initOut = os.Stdout })
	dir := t.TempDir()
	m1 := filepath.Join(dir, "m1")
	if err := runInit([]string{"--layers", "1", "--hidden", "32", "--vocab", "50", "--out", m1}); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadDir(m1)
	for _, out := range []string{filepath.Join(m1, "sub"), filepath.Join(m1, "a", "b")} {
		err := runInit([]string{"--layers", "1", "--hidden", "32", "--vocab", "50", "--out", out})
		want := "is inside " + m1 + ", a model directory (it holds config.json): a model nested in another's directory gets mixed up with it; choose a directory beside it, e.g. --out " + m1 + "-" + filepath.Base(out)
		if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), want) {
			t.Errorf("init --out %s: %v; want a usage error saying %q", out, err, want)
		}
	}
	if after, _ := os.ReadDir(m1); len(after) != len(before) {
		t.Errorf("m1 holds %d entries after the refused inits, want its %d", len(after), len(before))
	}
	// A config.json that is not a model's (a project's) does not make its
	// directory a model's.
	proj := filepath.Join(dir, "proj")
	os.MkdirAll(proj, 0o755)
	os.WriteFile(filepath.Join(proj, "config.json"), []byte(`{"name": "a web app", "port": 8080}`), 0o644)
	if err := runInit([]string{"--layers", "1", "--hidden", "32", "--vocab", "50", "--out", filepath.Join(proj, "models", "m")}); err != nil {
		t.Errorf("init under a directory with a non-model config.json: %v", err)
	}
}
