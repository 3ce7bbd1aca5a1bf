package main

import (
	"bytes"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"distill/train/trainer"
)

// TestExitStatus: what the command line alone gets wrong (a missing
// required flag, an unexpected argument, a bad flag value) exits 2,
// before anything is read; a failure of the work (a checkpoint or config
// that does not exist, a bad config) exits 1.
func TestExitStatus(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	out := filepath.Join(dir, "out")
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"tarin"}, 2, `unknown command "tarin": did you mean "train"?`},
		{[]string{"eval"}, 2, "student eval: --checkpoint is required"},
		{[]string{"eval", "--checkpoint", missing, "extra"}, 2, "unexpected arguments [extra]"},
		{[]string{"eval", "--checkpoint", missing}, 1, "no such run or checkpoint directory"},
		{[]string{"export", "--checkpoint", missing}, 2, "--checkpoint and --out are required"},
		{[]string{"export", "--checkpoint", missing, "--out", out, "--format", "fp8"}, 2, `--format "fp8": want bf16, f32, nvfp4 or peft`},
		{[]string{"export", "--checkpoint", missing, "--out", out}, 1, "no such run or checkpoint directory"},
		{[]string{"train", "--resume", "sometimes"}, 2, `--resume "sometimes": want auto, never or must`},
		{[]string{"train", "--nproc-per-node", "2", "extra"}, 2, "unexpected arguments [extra]"},
		{[]string{"train", "--nproc-per-node", "0"}, 2, "--nproc-per-node 0: want at least 1"},
		{[]string{"train", "--config", missing}, 1, "no such file or directory"},
		{[]string{"train"}, 2, "student train: --config FILE is required"},
		// A --set that is not key=value is a malformed flag value (it
		// exited 1, as a bad config); one the config refuses is 1.
		{[]string{"train", "--set", "optim.lr"}, 2, `--set "optim.lr": want key.path=value, e.g. --set optim.lr=3e-4`},
		{[]string{"train", "--config", missing, "--set", "=3e-4"}, 2, `--set "=3e-4": want key.path=value`},
		{[]string{"plan", "--config", missing, "--set", "data.seq_len"}, 2, `--set "data.seq_len": want key.path=value`},
		{[]string{"train", "--set", "optim.lr=fast"}, 1, "optim.lr"},
		{[]string{"init", "--out", out, "--arch", "gpt2"}, 2, `unknown architecture "gpt2"`},
		{[]string{"init", "--out", out, "--layers", "0"}, 2, "--layers 0: want positive numbers"},
		{[]string{"plan"}, 2, "--config is required"},
		{[]string{"plot", "--out", out}, 2, "--run DIR is required"},
		// plot's flag values are checked before any run is read (these
		// exited 1, after "runplot: bad input: ..."); a run that is not
		// there is a failure of the work.
		{[]string{"plot", "--run", missing, "--out", out + ".jpg"}, 2, `--out "` + out + `.jpg": the file name must end in .png, .svg or .pdf`},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--panels", "loss,foo"}, 2, `unknown panel "foo"`},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--hline", "1.23"}, 2, `--hline "1.23": no '='`},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--hline", "kd:x=1", "--panels", "ce"}, 2, "which --panels ce leaves out"},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--width", "-3"}, 2, "--width -3 --height 900: want 200..20000 x 150..20000 pixels"},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--width", "0"}, 2, "--width 0 --height 900: want"},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--height", "100"}, 2, "size 1500x100 pixels: want"},
		{[]string{"plot", "--run", missing, "--out", out + ".png", "--from", "-1"}, 2, "--from -1: want a step >= 0"},
		{[]string{"plot", "--run", missing, "--out", out + ".png"}, 1, "run directory " + missing + " does not exist"},
	} {
		var stderr bytes.Buffer
		code := commands.Run(tc.args, io.Discard, &stderr)
		if code != tc.code || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("student %s: exit %d, want %d; stderr %q lacks %q", strings.Join(tc.args, " "), code, tc.code, stderr.String(), tc.want)
		}
	}
}

// TestUsageSignalStatuses: `student -h` says what student train exits
// after SIGTERM, train.sigterm_exit_status (0 by default, as the README
// says), not the 143 of the other commands' jobs: its usage said "143 for
// SIGTERM" while the run exited 0.
func TestUsageSignalStatuses(t *testing.T) {
	var stdout bytes.Buffer
	if code := commands.Run([]string{"-h"}, &stdout, io.Discard); code != 0 {
		t.Fatalf("student -h: exit %d", code)
	}
	usage := strings.Join(strings.Fields(stdout.String()), " ")
	want := "after SIGTERM, student train exits its train.sigterm_exit_status: 0 by default, or 143"
	if !strings.Contains(usage, want) || strings.Contains(usage, "143 for SIGTERM") {
		t.Errorf("student -h:\n%s\nwant %q and not \"143 for SIGTERM\"", stdout.String(), want)
	}
	if d := trainer.Defaults().Train.SigtermExitStatus; d != 0 {
		t.Errorf("train.sigterm_exit_status defaults to %d; the usage says 0", d)
	}
}
