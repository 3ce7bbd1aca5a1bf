package cuda

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// The CPU emulator (testdata/emu) is a shared library that exports the
// CUDA driver's, NVRTC's and cuBLASLt's entry points and runs the kernels
// on the host, one fiber per CUDA thread. Pointing DISTILL_LIBCUDA,
// DISTILL_LIBNVRTC and DISTILL_LIBCUBLASLT at it runs the whole backend,
// Go code, launches and kernels, on machines without a GPU. What it cannot
// show: real concurrency (races), real tensor-core and cuBLASLt numerics,
// speed. Those need the GPU suite (scripts/gpu-suite.sh).

var (
	emuOnce sync.Once
	emuPath string
	emuErr  error
)

// emuSources are the files the emulator library is built from.
func emuSources() (map[string][]byte, error) {
	src := map[string][]byte{}
	for _, dir := range []string{"testdata/emu", "kernels"} {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			b, err := os.ReadFile(p)
			src[p] = b
			return err
		})
		if err != nil {
			return nil, err
		}
	}
	return src, nil
}

// buildEmu compiles the emulator library once per source version, into the
// user cache directory (the build takes a while on a small machine).
func buildEmu() (string, error) {
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("the emulator's fiber switch is written for linux/amd64, not %s/%s", runtime.GOOS, runtime.GOARCH)
	}
	cxx, err := exec.LookPath("g++")
	if err != nil {
		return "", fmt.Errorf("no g++ to build the emulator: %v", err)
	}
	srcs, err := emuSources()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	var names []string
	for n := range srcs {
		names = append(names, n)
	}
	sortStrings(names)
	for _, n := range names {
		fmt.Fprintf(h, "%s\x00%d\x00%s", n, len(srcs[n]), srcs[n])
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "distill", "cuda-emu", hex.EncodeToString(h.Sum(nil))[:16])
	lib := filepath.Join(dir, "libdistill_emu.so")
	if _, err := os.Stat(lib); err == nil {
		return lib, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	abs, _ := filepath.Abs(".")
	flags := []string{"-std=c++17", "-O2", "-g", "-fPIC", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"}
	objs := []string{}
	compile := func(name, src string) error {
		obj := filepath.Join(dir, name+".o")
		cmd := exec.Command(cxx, append(flags, "-c", "-x", "c++", "-", "-o", obj)...)
		cmd.Stdin = strings.NewReader(src)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("g++ %s: %v\n%s", name, err, out)
		}
		objs = append(objs, obj)
		return nil
	}
	emuDir := filepath.Join(abs, "testdata", "emu")
	if err := compile("emu", fmt.Sprintf("#include %q\n#include %q\n", filepath.Join(emuDir, "emu.h"), filepath.Join(emuDir, "emu.cpp"))); err != nil {
		return "", err
	}
	for _, f := range kernelFiles() {
		src := fmt.Sprintf("#include %q\n#include %q\n#include %q\n", filepath.Join(emuDir, "emu.h"),
			filepath.Join(abs, "kernels", "prelude.cuh"), filepath.Join(abs, "kernels", string(f)))
		if err := compile(strings.TrimSuffix(string(f), ".cu"), src); err != nil {
			return "", err
		}
	}
	tmp := lib + fmt.Sprintf(".tmp%d", os.Getpid())
	out, err := exec.Command(cxx, append([]string{"-shared", "-o", tmp}, objs...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("linking the emulator: %v\n%s", err, out)
	}
	return lib, os.Rename(tmp, lib)
}

func sortStrings(s []string) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// useEmu points the library variables at the emulator for the test.
func useEmu(t testing.TB) {
	t.Helper()
	emuOnce.Do(func() { emuPath, emuErr = buildEmu() })
	if emuErr != nil {
		if os.Getenv("DISTILL_REQUIRE_NVRTC") == "1" { // CI: the toolchain must be there
			t.Fatalf("DISTILL_REQUIRE_NVRTC=1 but the CPU emulator does not build: %v (scripts/setup.d/nvrtc.sh installs g++)", emuErr)
		}
		t.Skipf("CPU emulator unavailable, the backend's tests skipped: %v", emuErr)
	}
	for _, v := range []string{"DISTILL_LIBCUDA", "DISTILL_LIBNVRTC", "DISTILL_LIBCUBLASLT"} {
		t.Setenv(v, emuPath)
	}
}

// TestEmuReverseOrder reruns the kernels that use shared memory and warp
// collectives with the emulator's threads scheduled in reverse order
// (DISTILL_EMU_REVERSE=1), so that a barrier missing in either direction
// fails one of the two runs.
func TestEmuReverseOrder(t *testing.T) {
	if onGPU() {
		t.Skip("an emulator test")
	}
	t.Setenv("DISTILL_EMU_REVERSE", "1")
	t.Run("attention", TestAttentionConformance)
	t.Run("lmhead", TestLMHeadTopKConformance)
	t.Run("lmhead_ties", TestLMHeadTopKTies)
	t.Run("rmsnorm", TestRMSNormConformance)
	t.Run("rope", TestRoPEConformance)
	t.Run("moe", TestMoEConformance)
	t.Run("attn_plan", TestAttnPlanKernel)
}
