package main

import (
	"strings"
	"testing"

	"distill/internal/cli"
)

// TestFillStallTimeoutFlag: --stall-timeout is in the help with its
// default and what it is for; a negative one is a usage error (exit 2),
// said before any teacher is asked. (The watchdog itself is tested in
// package serve, against daemons whose forward hangs.)
func TestFillStallTimeoutFlag(t *testing.T) {
	out, _ := runFill(t, "-h")
	if !strings.Contains(out, "-stall-timeout") || !strings.Contains(out, "(default 10m0s)") || !strings.Contains(out, "older teacherd") {
		t.Errorf("fill -h does not document --stall-timeout:\n%s", out)
	}
	_, err := runFill(t, "--teacher", "127.0.0.1:1", "--data", "/data/d.jsonl", "--stall-timeout", "-1s")
	if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), "--stall-timeout -1s: want a duration >= 0 (0: no limit)") {
		t.Errorf("fill --stall-timeout -1s: %v (exit %d), want a usage error", err, cli.ExitStatus(err))
	}
}
