package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"distill/cache"
	"distill/internal/cli"
)

// TestReadersUsage: what the command line alone gets wrong in the cache
// readers, score, tokenize and plan exits 2 and names the flag: a stray
// argument (ignored before), a negative inspect window (a negative
// --from printed nothing), tokenize's --start/--end (exit 1, after the
// dataset loaded), score's --k and --temperature (refused by the
// teacher, exit 1, naming no flag; --temperature 0 scored at 1), score's
// flags of the other mode (ignored), plan's --weights (exit 1).
func TestReadersUsage(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	dpath := filepath.Join(t.TempDir(), "d.jsonl")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"inspect", "--cache", a, "--sample", "1", "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"export", "--cache", a, "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"verify", "--cache", a, "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"status", "--cache", a, "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"score", "--model", a, "--ids", "1", "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"inspect", "--cache", a, "--sample", "1", "--from", "-5"}, "--from -5: want 0 (the first position) or more"},
		{[]string{"inspect", "--cache", a, "--sample", "1", "--positions", "-1"}, "--positions -1: want 0 (all) or more"},
		{[]string{"inspect", "--cache", a, "--sample", "1", "--top", "-2"}, "--top -2: want 0 (all) or more"},
		{[]string{"tokenize", "--tokenizer", a, "--data", dpath, "--start", "-1"}, "--start -1 --end 0: want 0 <= --start < --end"},
		{[]string{"tokenize", "--tokenizer", a, "--data", dpath, "--start", "5", "--end", "3"}, "--start 5 --end 3: want 0 <= --start < --end"},
		{[]string{"score", "--model", a, "--ids", "1", "--k", "0"}, "--k 0: want 1 or more"},
		{[]string{"score", "--model", a, "--ids", "1", "--temperature", "0"}, "--temperature 0: want a positive temperature"},
		{[]string{"score", "--model", a, "--ids", "1", "--device", "gpu"}, `--device "gpu": want auto, cpu or cuda`},
		{[]string{"score", "--teacher", "127.0.0.1:1", "--ids", "1", "--device", "cpu"}, "--device is for --model"},
		{[]string{"score", "--model", a, "--ids", "1", "--token-file", dpath}, "are for --teacher"},
		{[]string{"plan", "--config", a, "--weights", "fp9"}, `--weights "fp9": want bf16 or fp8`},
	} {
		var stderr bytes.Buffer
		code := commands.Run(tc.args, io.Discard, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("cachectl %s: exit %d, want 2; stderr %q lacks %q", strings.Join(tc.args, " "), code, stderr.String(), tc.want)
		}
	}
}

// TestInspectFromPastTheEnd: a --from past the sample's last position is
// an error saying how many it has; it printed the header alone, as for
// a sample with no positions.
func TestInspectFromPastTheEnd(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	T := len(ctlSample(1, nil).Tokens)
	_, err := run(t, wrap(inspectMain), "--cache", a, "--sample", "1", "--from", "1000")
	if want := "sample 1 has " + itoa(T) + " positions (0 to " + itoa(T-1) + ")"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("inspect --from 1000: %v; want %q", err, want)
	}
	out, err := run(t, wrap(inspectMain), "--cache", a, "--sample", "1", "--from", itoa(T-1), "--top", "1")
	if err != nil || !strings.Contains(out, "pos "+itoa(T-1)+" ") {
		t.Fatalf("inspect --from its last position: %v\n%s", err, out)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

// TestScoreUnreachableTeacher: a daemon that does not answer is named
// with what to check, as fill says it, and what failed without gRPC's
// transport wording (it read `Info: connection error: desc = "transport:
// Error while dialing: dial tcp 127.0.0.1:1: connect: connection
// refused"`).
func TestScoreUnreachableTeacher(t *testing.T) {
	err := runScore([]string{"--teacher", "127.0.0.1:1", "--ids", "1,2"})
	if err == nil || !strings.Contains(err.Error(), "teacher 127.0.0.1:1: Info: cannot connect: dial tcp 127.0.0.1:1: ") || !strings.Contains(err.Error(), "is it running? check the address") ||
		strings.Contains(err.Error(), "rpc error") || strings.Contains(err.Error(), "desc =") || strings.Contains(err.Error(), "transport") {
		t.Fatalf("score --teacher at a closed port: %v", err)
	}
	// --retry-for 0s: at once (a fill waits --retry-for for a teacher).
	_, err = runFill(t, "--teacher", "127.0.0.1:1", "--data", "/data/d.jsonl", "--retry-for", "0s")
	if err == nil || !strings.Contains(err.Error(), "teacher 127.0.0.1:1: Info: cannot connect: dial tcp 127.0.0.1:1: ") || !strings.Contains(err.Error(), "is it running? check the address") ||
		strings.Contains(err.Error(), "desc =") || strings.Contains(err.Error(), "transport") {
		t.Fatalf("fill --teacher at a closed port: %v", err)
	}
}

// TestTokenizeRangePastTheDataset: a --start past the dataset with no
// --end says the dataset's range, not an --end the user never gave
// ("--start 5 --end 3").
func TestTokenizeRangePastTheDataset(t *testing.T) {
	needQwen3(t)
	d := filepath.Join(t.TempDir(), "d.jsonl")
	os.WriteFile(d, []byte("{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"text\": \"three\"}\n"), 0o644)
	for args, want := range map[string]string{
		"--start 5":          "--start 5: the dataset has samples [0, 3)",
		"--start 1 --end 9":  "--end 9: the dataset has samples [0, 3)",
		"--start 2 --end 3":  "",
		"--start 0 --end 0 ": "",
	} {
		_, _, err := runTok(t, append([]string{"--tokenizer", qwen3Dir, "--data", d}, strings.Fields(args)...)...)
		if want == "" && err != nil || want != "" && (err == nil || !strings.Contains(err.Error(), want)) {
			t.Errorf("tokenize %s: %v; want %q", args, err, want)
		}
	}
}

// TestInspectNegativeSample: a negative --sample is named as given; it
// was told "--sample INDEX is required". -h no longer shows the
// sentinel "(default -1)" of a required flag.
func TestInspectNegativeSample(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	out, err := run(t, wrap(inspectMain), "--cache", a, "--sample", "-5")
	if cli.ExitStatus(err) != 2 || err.Error() != "--sample -5: want a sample index, 0 or more" {
		t.Errorf("inspect --sample -5: %v", err)
	}
	if _, err := run(t, wrap(inspectMain), "--cache", a); cli.ExitStatus(err) != 2 || err.Error() != "--sample INDEX is required" {
		t.Errorf("inspect without --sample: %v", err)
	}
	out, _ = run(t, wrap(inspectMain), "-h")
	if strings.Contains(out, "default -1") {
		t.Errorf("inspect -h shows a default for the required --sample:\n%s", out)
	}
}
