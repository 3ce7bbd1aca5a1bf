package main

import (
	"bytes"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"distill/data"
)

// TestExitStatus: what the command line alone gets wrong (a missing
// required flag, flags that exclude each other, a bad flag value, an
// unknown command) exits 2; a failure of the work (a file that does not
// exist) exits 1. A dataset flag's error is still a data.ErrOptions.
func TestExitStatus(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	dpath := filepath.Join(dir, "missing.jsonl")
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"nope"}, 2, `unknown command "nope"`},
		{[]string{"fill"}, 2, "cachectl fill: give exactly one of --teacher"},
		{[]string{"fill", "--teacher", "x", "--model", "m"}, 2, "give exactly one of --teacher"},
		{[]string{"fill", "--model", "m", "--cache", missing, "--data", dpath, "--start", "5", "--end", "2"}, 2, "--start 5 --end 2: want"},
		{[]string{"fill", "--teacher", "x", "--data", dpath, "--format", "xml"}, 2, `--format "xml": want jsonl, csv or parquet`},
		{[]string{"fill", "--teacher", "x", "--data", dpath, "--targets", "all"}, 2, `--targets all`},
		{[]string{"fill", "--teacher", "x", "--data", dpath, "--cache", missing}, 2, "--cache is for --model"},
		{[]string{"fill", "--model", "m", "--cache", missing, "--data", dpath}, 1, "--data: " + dpath + " does not exist"},
		{[]string{"status"}, 2, "cachectl status: --cache DIR is required"},
		{[]string{"status", "--cache", missing}, 1, "does not exist"},
		{[]string{"plan"}, 2, "--config is required"},
		{[]string{"plan", "--config", missing}, 1, missing},
		{[]string{"tokenize", "--tokenizer", missing}, 2, "--data is required"},
	} {
		var stderr bytes.Buffer
		code := commands.Run(tc.args, io.Discard, &stderr)
		if code != tc.code || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("cachectl %s: exit %d, want %d; stderr %q lacks %q", strings.Join(tc.args, " "), code, tc.code, stderr.String(), tc.want)
		}
	}
	_, err := runFill(t, "--teacher", "x", "--data", dpath, "--policy", "cut")
	if !errors.Is(err, data.ErrOptions) {
		t.Errorf("fill --policy cut: %v, want a data.ErrOptions", err)
	}
}
