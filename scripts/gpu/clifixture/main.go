// Command clifixture makes what the GPU suite's cli step
// (scripts/gpu-suite.sh, scripts/gpu/student_cli.sh) needs beyond the
// student binary:
//
//	go run ./scripts/gpu/clifixture cache DIR
//
// writes a tiny real cache to DIR (train/testcache: a random Qwen3 teacher's
// top-8 over a 97-token vocabulary, 48 samples; the cache cmd/student's
// tests train on), built here because the GPU machine has no Go toolchain;
//
//	go run ./scripts/gpu/clifixture emu-lib
//
// prints the CPU emulator of CUDA's library (compute/cuda/cudaemu, built
// from this source tree on first use), which DISTILL_GPU_SUITE_EMU=1 points
// DISTILL_LIBCUDA and the others at for the student binary, as the tests'
// cudaemu.Use does for a test.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"distill/compute/cuda/cudaemu"
	"distill/train/testcache"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "clifixture:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	switch {
	case len(args) == 2 && args[0] == "cache":
		return writeCache(args[1])
	case len(args) == 1 && args[0] == "emu-lib":
		lib, err := cudaemu.Library()
		if err != nil {
			return err
		}
		fmt.Println(lib)
		return nil
	}
	return fmt.Errorf("usage: clifixture cache DIR | clifixture emu-lib")
}

// writeCache builds the cache beside DIR, then renames it into place
// (the teacher checkpoint it was computed from is left out).
func writeCache(dir string) error {
	if _, err := os.Stat(dir); err == nil {
		return fmt.Errorf("%s exists", dir)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".clifixture-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	b, err := testcache.Build(testcache.Options{Dir: tmp, Vocab: 97, K: 8, Samples: 48, Chunk: 16, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		return err
	}
	return os.Rename(b.CacheDir, dir)
}
