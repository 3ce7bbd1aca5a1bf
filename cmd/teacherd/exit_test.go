package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/internal/cli"
	"distill/serve"
)

// TestExitStatus: teacherd exits as cachectl and student do: 0 for
// --help (it was 2), 2 for what the command line alone gets wrong (a bad
// flag value too: those exited 1, refused by serve.Start with the config
// file's values), 1 for a failure (a model directory that does not
// exist).
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
		{[]string{"--model", missing, "--devices", "0,x"}, 2, `--devices "0,x": want GPU ordinals separated by commas (0,1,2,3) or all`},
		{[]string{"--model", missing, "--device", "gpu"}, 2, `--device "gpu": want auto, cpu or cuda`},
		{[]string{"--model", missing, "--weights", "fp4"}, 2, `--weights "fp4": want bf16 or fp8`},
		{[]string{"--plan", "--model", missing, "--weights", "fp4"}, 2, `--weights "fp4": want bf16 or fp8`},
		{[]string{"--model", missing, "--micro-batches", "-1"}, 2, "--micro-batches -1: want 0 (four a GPU) or more"},
		{[]string{"--model", missing, "--token-budget", "-5"}, 2, "--token-budget -5: want a positive number (0 or none: the default, 8192)"},
		{[]string{"--model", missing, "--max-concurrent", "-1"}, 2, "--max-concurrent -1: want a positive number"},
		{[]string{"--model", missing, "--queue-samples", "-1"}, 2, "--queue-samples -1: want a positive number"},
		{[]string{"--model", missing, "--queue-tokens", "-1"}, 2, "--queue-tokens -1: want a positive number"},
		{[]string{"--model", missing, "--max-draws", "5000"}, 2, "--max-draws 5000: want 1 to 4096 draws a position"},
		{[]string{"--model", missing, "--drain-timeout", "-1s"}, 2, "--drain-timeout -1s: want a positive duration"},
		{[]string{"--model", missing, "--listen", "7070"}, 2, "--listen 7070: address 7070: missing port in address: want HOST:PORT, e.g. 127.0.0.1:7070"},
		{[]string{"--model", missing, "--metrics", "9090"}, 2, "--metrics 9090: address 9090: missing port in address: want HOST:PORT"},
		{[]string{"--model", missing, "--metrics", "off", "--listen", "127.0.0.1:0"}, 1, "--model " + missing},
	} {
		err := run(tc.args)
		if code := cli.ExitStatus(err); code != tc.code || (tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want))) {
			t.Errorf("teacherd %s: %v, exit %d, want %d and %q", strings.Join(tc.args, " "), err, code, tc.code, tc.want)
		}
	}
}

// TestConfigFileValues: a bad value in the config file is the file's
// failure (exit 1), named by its key and the file, not by a flag the
// user never gave (it said `--weights "fp4": ...`); a flag given
// overrides the file's value, a bad one too, and a bad flag is a usage
// error whatever the file says.
func TestConfigFileValues(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	p := filepath.Join(t.TempDir(), "t.yaml")
	for _, tc := range []struct {
		yaml, want string
	}{
		{"weights: fp4\n", `config ` + p + `: weights: "fp4": want bf16 or fp8`},
		{"device: gpu\n", `config ` + p + `: device: "gpu": want auto, cpu or cuda`},
		{"devices: 0,x\n", `config ` + p + `: devices: "0,x": want GPU ordinals separated by commas (0,1,2,3) or all`},
		{"micro_batches: -1\n", "config " + p + ": micro_batches: -1: want 0 (four a GPU) or more"},
		{"queue_tokens: -1\n", "config " + p + ": queue_tokens: -1: want a positive number (0 or none: the default, 8 token budgets)"},
		{"max_draws: 5000\n", "config " + p + ": max_draws: 5000: want 1 to 4096 draws a position"},
		{"drain_timeout: -1s\n", "config " + p + ": drain_timeout: -1s: want a positive duration"},
		{"listen: \"7070\"\n", "config " + p + ": listen: 7070: address 7070: missing port in address: want HOST:PORT"},
	} {
		if err := os.WriteFile(p, []byte("model: "+missing+"\n"+tc.yaml), 0o644); err != nil {
			t.Fatal(err)
		}
		err := run([]string{"--config", p})
		if code := cli.ExitStatus(err); code != 1 || err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, serve.ErrConfig) {
			t.Errorf("%q in the file: %v, exit %d, want exit 1 and %q", tc.yaml, err, code, tc.want)
		}
	}
	os.WriteFile(p, []byte("model: "+missing+"\nweights: fp4\ndevices: 0,x\n"), 0o644)
	if cfg, _, _, err := parseConfig([]string{"--config", p, "--weights", "fp8", "--devices", "0,1"}); err != nil || cfg.Weights != "fp8" || cfg.Devices != "0,1" {
		t.Errorf("flags over the file's bad values: %+v, %v", cfg, err)
	}
	err := run([]string{"--config", p, "--weights", "fp5"})
	if code := cli.ExitStatus(err); code != 2 || err == nil || err.Error() != `--weights "fp5": want bf16 or fp8` {
		t.Errorf("--weights fp5 over the file's fp4: %v, exit %d", err, code)
	}
}
