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
		// Flags that exclude each other, as cachectl fill refuses them
		// (exit 2); all too, whose GPUs are counted only once the driver
		// loads: it said the CUDA driver would not load instead.
		{[]string{"--model", missing, "--device", "cpu", "--devices", "0,1"}, 2,
			"--device cpu --devices 0,1: --devices places the teacher's layers on GPUs: use --device cuda (or auto) with it, or leave --devices out to run on the CPU"},
		{[]string{"--model", missing, "--device", "cpu", "--devices", "all"}, 2, "--device cpu --devices all: --devices places the teacher's layers on GPUs"},
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
		// k bounds and the TLS pair wrong on their face: refused before
		// the model's config.json is read (they exited 1 once it had
		// been; the missing model would be exit 1 here).
		{[]string{"--model", missing, "--k-max", "-3"}, 2, "--k-max -3: want 1 or more, at most the teacher's vocab size (0 or none: the default, min(vocab size, 4096))"},
		{[]string{"--model", missing, "--k-default", "-1"}, 2, "--k-default -1: want 1 or more, at most k-max (0 or none: the default, min(64, k-max))"},
		{[]string{"--model", missing, "--k-default", "100", "--k-max", "10"}, 2, "--k-default 100: want 1 <= k-default <= 10 (--k-max)"},
		{[]string{"--model", missing, "--k-default", "5000"}, 2, "--k-default 5000: want 1 <= k-default <= 4096 (the default k-max, min(vocab size, 4096)); give --k-max too for more"},
		{[]string{"--model", missing, "--tls-cert", "/x"}, 2, "--tls-cert /x: TLS needs --tls-key too (the certificate's private key, PEM), or neither for no TLS"},
		{[]string{"--model", missing, "--tls-key", "/k"}, 2, "--tls-key /k: TLS needs --tls-cert too (the key's certificate, PEM), or neither for no TLS"},
		{[]string{"--plan", "--model", missing, "--k-max", "-3"}, 2, "--k-max -3: want 1 or more"},
		// A --model that does not exist said only "want a config.json".
		{[]string{"--plan", "--model", missing, "--device-memory", "80GiB"}, 1, missing + " does not exist: check the path"},
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
		{"k_max: -3\n", "config " + p + ": k_max: -3: want 1 or more, at most the teacher's vocab size"},
		{"k_default: -1\n", "config " + p + ": k_default: -1: want 1 or more, at most k-max"},
		{"k_default: 100\nk_max: 10\n", "config " + p + ": k_default: 100: want 1 <= k_default <= 10 (k_max)"},
		{"k_default: 5000\n", "config " + p + ": k_default: 5000: want 1 <= k_default <= 4096 (the default k_max, min(vocab size, 4096)); give k_max too for more"},
		{"tls_cert: /x\n", "config " + p + ": tls_cert: /x: TLS needs tls_key too (the certificate's private key, PEM), or neither for no TLS"},
		{"tls_key: /k\n", "config " + p + ": tls_key: /k: TLS needs tls_cert too (the key's certificate, PEM), or neither for no TLS"},
		{"device: cpu\ndevices: all\n", "config " + p + ": device: cpu, config " + p + ": devices: all: devices places the teacher's layers on GPUs: use device cuda (or auto) with it, or leave devices out to run on the CPU"},
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

// TestPairsFromBothSources: settings that must agree (--k-default at
// most --k-max, --tls-cert with --tls-key) are checked once the flags
// and the file are merged, so a flag and the file's key make a pair; a
// pair that does not agree names each value where it came from, and is
// a usage error (exit 2) when a flag given is one of the pair, the
// file's (exit 1) when neither is.
func TestPairsFromBothSources(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	p := filepath.Join(t.TempDir(), "t.yaml")
	for _, tc := range []struct {
		yaml string
		args []string
		code int    // -1: parseConfig accepts it
		want string // the whole message
	}{
		{"k_max: 10\n", []string{"--k-default", "100"}, 2, "--k-default 100: want 1 <= k-default <= 10 (k_max in config " + p + ")"},
		{"k_default: 100\n", []string{"--k-max", "10"}, 2, "config " + p + ": k_default: 100: want 1 <= k_default <= 10 (--k-max)"},
		{"k_default: 100\nk_max: 10\n", []string{"--k-max", "200"}, -1, ""},
		{"k_default: 100\nk_max: 10\n", []string{"--k-default", "5"}, -1, ""},
		{"k_default: 100\nk_max: 10\n", []string{"--listen", "127.0.0.1:0"}, 1, "config " + p + ": k_default: 100: want 1 <= k_default <= 10 (k_max)"},
		{"tls_cert: /x\n", []string{"--tls-key", "/k"}, -1, ""},
		{"tls_key: /k\n", []string{"--tls-cert", "/x"}, -1, ""},
		// An empty flag drops the file's half: the command line's doing.
		{"tls_cert: /x\ntls_key: /k\n", []string{"--tls-key", ""}, 2, "config " + p + ": tls_cert: /x: TLS needs tls_key too (the certificate's private key, PEM), or neither for no TLS"},
		{"device: cpu\n", []string{"--devices", "0,1"}, 2, "config " + p + ": device: cpu, --devices 0,1: --devices places the teacher's layers on GPUs: use device cuda (or auto) with it, or leave --devices out to run on the CPU"},
		{"devices: all\n", []string{"--device", "cpu"}, 2, "--device cpu, config " + p + ": devices: all: devices places the teacher's layers on GPUs: use --device cuda (or auto) with it, or leave devices out to run on the CPU"},
		{"device: cpu\ndevices: all\n", []string{"--device", "cuda"}, -1, ""},
	} {
		if err := os.WriteFile(p, []byte("model: "+missing+"\n"+tc.yaml), 0o644); err != nil {
			t.Fatal(err)
		}
		args := append([]string{"--config", p}, tc.args...)
		_, _, _, err := parseConfig(args)
		if tc.code < 0 {
			if err != nil {
				t.Errorf("%q, teacherd %s: %v", tc.yaml, strings.Join(args, " "), err)
			}
			continue
		}
		if code := cli.ExitStatus(err); code != tc.code || err == nil || err.Error() != tc.want || !errors.Is(err, serve.ErrConfig) {
			t.Errorf("%q, teacherd %s: %v, exit %d\nwant exit %d and %s", tc.yaml, strings.Join(args, " "), err, code, tc.code, tc.want)
		}
	}
}

// TestFileValuesNamedAtStart: what Start finds wrong with a value once it
// reads more than the value (the model's config.json, the files named)
// names the config file's key when the value is the file's, not a flag
// the user never gave (it said "--k-max 100: ..." for the file's k_max),
// and the flag when a flag overrode the file. A k-max above the
// teacher's vocabulary stays a failure (exit 1), as a --devices GPU the
// machine lacks does: the value is right on its face, and the command
// line alone does not tell it is wrong.
func TestFileValuesNamedAtStart(t *testing.T) {
	m := tinyModelDir(t) // vocab 64
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	p := filepath.Join(dir, "t.yaml")
	for _, tc := range []struct {
		yaml string
		args []string
		want string // the message's start
	}{
		{"model: " + m + "\nk_max: 100\n", nil, "config " + p + ": k_max: 100: want 1 <= k_max <= 64 (the teacher's vocab size)"},
		{"model: " + m + "\nk_max: 10\n", []string{"--k-max", "100"}, "--k-max 100: want 1 <= k-max <= 64 (the teacher's vocab size)"},
		{"model: " + m + "\nk_default: 100\n", nil, "config " + p + ": k_default: 100: want 1 <= k_default <= 64 (the default k_max, min(vocab size 64, 4096))"},
		{"model: " + missing + "\n", nil, "config " + p + ": model: " + missing + ": checkpoint directory " + missing + " does not exist"},
		{"model: /m\n", []string{"--model", missing}, "--model " + missing + ": checkpoint directory " + missing + " does not exist"},
		{"model: " + m + "\ncache: " + p + "\n", nil, "config " + p + ": cache: " + p + " is a file, not a directory"},
		{"model: " + m + "\ntokenizer: " + dir + "\n", nil, "config " + p + ": tokenizer: " + dir + ": no tokenizer.json there (no such file or directory): give the directory that holds the teacher's tokenizer.json, or no tokenizer for the model directory's"},
		{"model: " + m + "\ntoken_file: " + missing + "\n", nil, "config " + p + ": token_file: " + missing + ": no such file or directory: give the file that holds the bearer token clients send (one line), or no token_file for no authentication"},
		{"model: " + m + "\ntls_cert: " + missing + "\n", []string{"--tls-key", missing}, "config " + p + ": tls_cert: " + missing + ", --tls-key " + missing + ": open "},
		{"model: " + m + "\ndata_roots: [" + dir + ", " + missing + "]\n", nil, "config " + p + ": data_roots: " + missing + ": no such file or directory (give an existing directory)"},
		{"model: " + m + "\ndata_roots: [" + missing + "]\n", []string{"--data-root", p}, "--data-root " + p + " is not a directory"},
	} {
		if err := os.WriteFile(p, []byte(tc.yaml), 0o644); err != nil {
			t.Fatal(err)
		}
		args := append([]string{"--config", p, "--listen", "127.0.0.1:0", "--metrics", "off", "--device", "cpu"}, tc.args...)
		err := run(args)
		if code := cli.ExitStatus(err); code != 1 || err == nil || !strings.HasPrefix(err.Error(), tc.want) || !errors.Is(err, serve.ErrConfig) {
			t.Errorf("%q, teacherd %s: %v, exit %d\nwant exit 1 and %s...", tc.yaml, strings.Join(args, " "), err, code, tc.want)
		}
	}
}
