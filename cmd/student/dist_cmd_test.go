package main

import (
	"distill/train/testcache"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestWithoutFlag(t *testing.T) {
	cases := []struct{ in, want []string }{
		{[]string{"--config", "c", "--nproc-per-node", "2", "--set", "a=1"}, []string{"--config", "c", "--set", "a=1"}},
		{[]string{"-nproc-per-node=4", "--config", "c"}, []string{"--config", "c"}},
		{[]string{"--nproc-per-node=4"}, nil},
		{[]string{"--config", "c", "--", "--nproc-per-node", "2"}, []string{"--config", "c", "--", "--nproc-per-node", "2"}},
		{[]string{"--nproc-per-node-x", "1"}, []string{"--nproc-per-node-x", "1"}},
	}
	for _, c := range cases {
		if got := withoutFlag(c.in, "nproc-per-node"); !reflect.DeepEqual(got, c.want) {
			t.Errorf("withoutFlag(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestTrainNProcPerNode: `student train --nproc-per-node 2` starts two
// ranks of this binary, prefixed in its output; on the CPU, which has no
// collectives, each rank stops saying that data-parallel training needs
// train.device cuda (NCCL), and the job fails naming a rank. (On the CUDA
// emulator, with its NCCL stand-in, the ranks train: package trainer's
// TestCUDADataParallel.)
func TestTrainNProcPerNode(t *testing.T) {
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "cache"), Vocab: 97, K: 8, Samples: 16, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	os.WriteFile(cfg, []byte(`run_dir: `+filepath.Join(dir, "run")+`
model:
  random: {arch: qwen3, vocab_size: 97, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
           num_key_value_heads: 1, head_dim: 16, intermediate_size: 64, max_position_embeddings: 128}
  tokenizer_fingerprint: testcache-tokenizer
data: {cache: [`+b.CacheDir+`], seq_len: 64, global_batch_tokens: 128}
train: {max_steps: 2, threads: 1, device: cpu}
log: {progress: "off"}
`), 0o644)
	// On the CPU there are no collectives: each rank says what to set.
	p := startStudent(t, "train", "--config", cfg, "--nproc-per-node", "2")
	if code := p.wait(t); code != 1 {
		t.Fatalf("exit status %d, want 1; stderr:\n%s", code, p.stderr.String())
	}
	out := p.stderr.String()
	for _, want := range []string{
		"[rank 0] student train: rank 0 of 2",
		"[rank 1] student train: rank 1 of 2",
		"data-parallel training runs on GPUs through NCCL",
		"set train.device: cuda",
		"exited with status 1",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stderr lacks %q:\n%s", want, out)
		}
	}
}
