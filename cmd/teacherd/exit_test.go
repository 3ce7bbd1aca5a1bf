package main

import (
	"path/filepath"
	"strings"
	"testing"

	"distill/internal/cli"
)

// TestExitStatus: teacherd exits as cachectl and student do: 0 for
// --help (it was 2), 2 for what the command line alone gets wrong, 1 for
// a failure (a model directory that does not exist).
func TestExitStatus(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--help"}, 0, ""},
		{[]string{"--modle", missing}, 2, "flag provided but not defined: -modle (did you mean --model?)"},
		{[]string{"--token-budget", "lots"}, 2, `invalid value "lots" for flag -token-budget`},
		{[]string{"--model", missing, "extra"}, 2, `unexpected arguments ["extra"]`},
		{[]string{"--model", missing, "--device-memory", "80GiB"}, 2, "--device-memory is for --plan"},
		{[]string{"--plan"}, 2, "--plan needs --model DIR"},
		{[]string{"--plan", "--model", missing, "--device-memory", "lots"}, 2, "--device-memory"},
		{[]string{"--model", missing, "--metrics", "off", "--listen", "127.0.0.1:0"}, 1, "--model " + missing},
	} {
		err := run(tc.args)
		if code := cli.ExitStatus(err); code != tc.code || (tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want))) {
			t.Errorf("teacherd %s: %v, exit %d, want %d and %q", strings.Join(tc.args, " "), err, code, tc.code, tc.want)
		}
	}
}
