package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
)

// TestFillWeightsFP8: cachectl fill --model DIR --teacher-weights fp8 fills with
// the FP8 teacher (its entries are infer.LoadWith's FP8 forward, bit for
// bit, and differ from the BF16 teacher's), and the cache refuses a BF16
// fill into it: the two teachers' fingerprints differ.
func TestFillWeightsFP8(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	var samples [][]int32
	var lines []string
	for i := 0; i < 9; i++ {
		s := make([]int32, 4+i%5)
		for j := range s {
			s[j] = int32((i*37 + j*11) % 300)
		}
		samples = append(samples, s)
		b, _ := json.Marshal(map[string]any{"input_ids": s})
		lines = append(lines, string(b))
	}
	dpath := filepath.Join(tmp, "d.jsonl")
	os.WriteFile(dpath, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
	cdir := filepath.Join(tmp, "cache")
	args := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "4", "--k", "4", "--encoding", "lossless", "--device", "cpu"}
	if out, err := runFill(t, append(args, "--teacher-weights", "fp8")...); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	fp8, err := infer.LoadWith(mdir, device.CPU(0), infer.LoadOptions{Weights: infer.WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	bf16, err := infer.Load(mdir, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	r, err := cache.OpenReader(cdir)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Manifest().TeacherFingerprint; got != fp8.Fingerprint() || got == bf16.Fingerprint() {
		t.Fatalf("cache fingerprint %.16s: fp8 teacher %.16s, bf16 %.16s", got, fp8.Fingerprint(), bf16.Fingerprint())
	}
	differ := false
	for _, ch := range r.Chunks() { // a chunk is one forward: the same GEMM shapes
		want, _ := fp8.TopK(samples[ch.Start:ch.End], infer.Options{K: 4})
		ref, _ := bf16.TopK(samples[ch.Start:ch.End], infer.Options{K: 4})
		for i := ch.Start; i < ch.End; i++ {
			got, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			w, b := want[i-ch.Start], ref[i-ch.Start]
			for j, id := range w.IDs {
				if got.TopKIDs[j] != id || math.Float32bits(got.TopKLogProbs[j]) != math.Float32bits(w.LogProbs[j]) {
					t.Fatalf("sample %d entry %d differs from the FP8 forward", i, j)
				}
				differ = differ || got.TopKLogProbs[j] != b.LogProbs[j]
			}
		}
	}
	if !differ {
		t.Fatal("the FP8 fill equals the BF16 teacher's outputs: the FP8 path did not run")
	}
	out, err := runFill(t, append(args, "--end", "9")...) // bf16 into the fp8 cache
	if err == nil || !strings.Contains(out+err.Error(), "fingerprint") {
		t.Fatalf("bf16 fill into an fp8 cache: err %v\n%s", err, out)
	}
	t.Logf("refused: %v", err)
	if _, err := runFill(t, "--teacher", "x:1", "--data", dpath, "--teacher-weights", "fp8"); err == nil || !strings.Contains(err.Error(), "--teacher-weights is for --model") {
		t.Errorf("--teacher-weights with --teacher: %v", err)
	}
	if _, err := runFill(t, append(args, "--teacher-weights", "int8")...); err == nil || !strings.Contains(err.Error(), `weights "int8": want bf16 or fp8`) {
		t.Errorf("--teacher-weights int8: %v", err)
	}
}
