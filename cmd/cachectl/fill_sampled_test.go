package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
)

// TestHelperFillProcess is not a test: TestFillSampledReproducible runs
// the test binary with CACHECTL_FILL_ARGS to fill in another process.
func TestHelperFillProcess(t *testing.T) {
	args := os.Getenv("CACHECTL_FILL_ARGS")
	if args == "" {
		t.Skip("helper process of TestFillSampledReproducible")
	}
	if out, err := runFill(t, strings.Split(args, "\x1f")...); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
}

func chunkBytes(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(dir, "chunks", "*.arrow"))
	out := map[string][]byte{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(f)] = b
	}
	return out
}

// TestFillSampledReproducible fills the same range with sampled and
// head+sampled targets in this process, again in this process, and in
// another process: the chunk files are byte-identical (the draws are keyed
// by dataset, sample, position and draw, not by RNG state), verify passes,
// and the manifest says the kind.
func TestFillSampledReproducible(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	dpath := filepath.Join(tmp, "ids.jsonl")
	writeIDs(t, dpath, idSamples(15, 300))
	for _, kind := range []string{"sampled", "head+sampled"} {
		args := func(dir string) []string {
			a := []string{"--model", mdir, "--cache", dir, "--data", dpath, "--pretokenized", "--chunk", "6", "--device", "cpu",
				"--targets", kind, "--samples", "24"}
			if kind == "head+sampled" {
				a = append(a, "--k", "4")
			}
			return a
		}
		var dirs []string
		for i := 0; i < 2; i++ {
			d := filepath.Join(tmp, kind, string(rune('a'+i)))
			if out, err := runFill(t, args(d)...); err != nil {
				t.Fatalf("%s: %v\n%s", kind, err, out)
			}
			dirs = append(dirs, d)
		}
		d := filepath.Join(tmp, kind, "process")
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFillProcess$")
		cmd.Env = append(os.Environ(), "CACHECTL_FILL_ARGS="+strings.Join(args(d), "\x1f"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: fill in another process: %v\n%s", kind, err, out)
		}
		dirs = append(dirs, d)
		want := chunkBytes(t, dirs[0])
		if len(want) != 3 {
			t.Fatalf("%s: %d chunks, want 3", kind, len(want))
		}
		for _, d := range dirs[1:] {
			got := chunkBytes(t, d)
			for name, b := range want {
				if !bytes.Equal(got[name], b) {
					t.Fatalf("%s: chunk %s of %s differs from the first fill's", kind, name, d)
				}
			}
		}
		var vout, verr bytes.Buffer
		if err := verifyMain([]string{"--cache", dirs[0]}, &vout, &verr); err != nil {
			t.Fatalf("verify: %v\n%s%s", err, vout.String(), verr.String())
		}
		r, err := cache.OpenReader(dirs[0])
		if err != nil {
			t.Fatal(err)
		}
		m := r.Manifest()
		if string(m.Kind()) != kind || m.Draws != 24 || m.FormatVersion != cache.FormatVersionSampled {
			t.Fatalf("manifest: %+v", m)
		}
		s, err := r.Get(3)
		if err != nil {
			t.Fatal(err)
		}
		if len(s.DrawN) != len(s.Tokens) || (kind == "head+sampled") != (len(s.TailMass) == len(s.Tokens)) {
			t.Fatalf("%s sample 3: %d tokens, draw_n %d, tail %d", kind, len(s.Tokens), len(s.DrawN), len(s.TailMass))
		}
	}
}

// TestFillSampledBadFlags: bad --targets/--samples/--k are refused before
// anything is loaded or written, naming the flag and the bound.
func TestFillSampledBadFlags(t *testing.T) {
	tmp := t.TempDir()
	dpath := filepath.Join(tmp, "ids.jsonl")
	writeIDs(t, dpath, idSamples(3, 300))
	cdir := filepath.Join(tmp, "cache")
	for _, c := range []struct {
		flags []string
		want  string
	}{
		{[]string{"--targets", "sampled", "--samples", "0"}, "samples 0 with targets sampled: want 1 to 4096 draws per position"},
		{[]string{"--targets", "sampled", "--samples", "100000"}, "--samples 100000: want 1 to 4096"},
		{[]string{"--targets", "sampled", "--samples", "8", "--k", "4"}, "--k 4 with --targets sampled: a sampled cache has no top-k head"},
		{[]string{"--targets", "gumbel", "--samples", "8"}, `targets "gumbel": want topk, sampled or head+sampled`},
		{[]string{"--samples", "8"}, "samples 8 with targets topk"},
	} {
		args := append([]string{"--model", "/nonexistent", "--cache", cdir, "--data", dpath, "--pretokenized"}, c.flags...)
		out, err := runFill(t, args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v\n%s\nwant an error naming %q", c.flags, err, out, c.want)
		}
		if _, err := os.Stat(cdir); err == nil {
			t.Fatalf("%v: the cache directory was created", c.flags)
		}
	}
}
