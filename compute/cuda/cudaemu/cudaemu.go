// Package cudaemu builds the CPU emulator of the CUDA driver, NVRTC,
// cuBLASLt and cuDNN's graph API (compute/cuda/testdata/emu) and points a
// test at it, so that
// compute/cuda, and whatever opens it (compute/device, the teacher), runs
// its Go code, its launches and its kernels on machines without a GPU.
//
// The emulator is a shared library that exports the four libraries' entry
// points and runs the kernels on the host, one fiber per CUDA thread,
// switching at barriers; it is built with g++ from the same kernel sources
// as the GPU runs. Its cuDNN part (emu_cudnn.cpp) interprets backend
// operation graphs (matmul, pointwise, reduction, reshape; ragged tensors,
// GEMM size overrides) in double precision. It emulates
// DISTILL_EMU_DEVICES GPUs (default 1), each with its own memory
// (DISTILL_EMU_DEVICE_MEM, or DISTILL_EMU_DEVICE_MEM_<ordinal> for one),
// contexts, streams and pool, with peer access between them unless
// DISTILL_EMU_PEER=0 (emu.cpp's header says what it checks). It runs each
// stream's work when it is issued, and checks the order between streams
// that a GPU would not keep: work on two streams touching one allocation
// with no event or host synchronization between them fails, naming both
// (emu.cpp, "stream order"; DISTILL_EMU_RACE=0 turns it off). What it
// cannot show: races inside a kernel, timing, real tensor-core, cuBLASLt
// and cuDNN numerics, which graphs cuDNN's engines accept, speed. Those need the GPU suite
// (scripts/gpu-suite.sh).
//
// It is for tests only: it builds from the source tree. With
// DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh sets it) the same tests run
// on the machine's real GPU instead.
package cudaemu

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
)

var (
	once    sync.Once
	libPath string
	libErr  error
)

// Library returns the emulator library's path, building it on first use
// (once per process, and once per source version on the machine: the
// build is cached in the user cache directory).
func Library() (string, error) {
	once.Do(func() { libPath, libErr = build() })
	return libPath, libErr
}

// OnGPU reports whether the tests target a real GPU: DISTILL_CUDA_TEST=gpu.
func OnGPU() bool { return os.Getenv("DISTILL_CUDA_TEST") == "gpu" }

// Use points DISTILL_LIBCUDA, DISTILL_LIBNVRTC, DISTILL_LIBCUBLASLT,
// DISTILL_LIBCUDNN and DISTILL_LIBNCCL at the emulator for the rest of t,
// unless OnGPU: then
// the test runs on the real GPU and its libraries. Without a way to build
// the emulator (no g++, not linux/amd64) the test is skipped, or fails
// where DISTILL_REQUIRE_NVRTC=1 (CI, where scripts/setup.d/nvrtc.sh
// installs the toolchain).
func Use(t testing.TB) {
	t.Helper()
	if OnGPU() {
		return
	}
	lib, err := Library()
	if err != nil {
		if os.Getenv("DISTILL_REQUIRE_NVRTC") == "1" {
			t.Fatalf("DISTILL_REQUIRE_NVRTC=1 but the CPU emulator of CUDA does not build: %v (scripts/setup.d/nvrtc.sh installs g++)", err)
		}
		t.Skipf("CPU emulator of CUDA unavailable, test skipped: %v", err)
	}
	for _, v := range []string{"DISTILL_LIBCUDA", "DISTILL_LIBNVRTC", "DISTILL_LIBCUBLASLT", "DISTILL_LIBCUDNN", "DISTILL_LIBNCCL"} {
		t.Setenv(v, lib)
	}
}

// UseDevices is Use for a test of n emulated GPUs (DISTILL_EMU_DEVICES),
// with a kernel cache of its own: a test of several GPUs, or of a GPU the
// emulator shrinks, runs on the emulator only, and is skipped on a real
// GPU (OnGPU), whose machine has the GPUs it has, saying why.
func UseDevices(t testing.TB, n int, why string) {
	t.Helper()
	Use(t)
	if OnGPU() {
		t.Skip(why)
	}
	t.Setenv("DISTILL_EMU_DEVICES", strconv.Itoa(n))
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
}

// cudaDir is compute/cuda in the source tree: where this file was
// compiled, or else (a binary built elsewhere or with -trimpath) under
// the module root above the working directory.
func cudaDir() (string, error) {
	has := func(dir string) bool {
		_, err := os.Stat(filepath.Join(dir, "testdata", "emu", "emu.cpp"))
		return err == nil
	}
	var tried []string
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		dir := filepath.Dir(filepath.Dir(file))
		if has(dir) {
			return dir, nil
		}
		tried = append(tried, dir)
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				dir := filepath.Join(d, "compute", "cuda")
				if has(dir) {
					return dir, nil
				}
				tried = append(tried, dir)
				break
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return "", fmt.Errorf("the emulator's sources (compute/cuda/testdata/emu) are not found: tried %q and the module root above the working directory", tried)
}

// build compiles the emulator library into the user cache directory,
// under a hash of its sources (testdata/emu and kernels/): every .cpp file
// directly in testdata/emu (emu.cpp, emu_cudnn.cpp), each after emu.h, and
// every kernel.
func build() (string, error) {
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("the emulator's fiber switch is written for linux/amd64, not %s/%s", runtime.GOOS, runtime.GOARCH)
	}
	cxx, err := exec.LookPath("g++")
	if err != nil {
		return "", fmt.Errorf("no g++ to build the emulator: %v", err)
	}
	root, err := cudaDir()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	var kernels []string
	for _, sub := range []string{"testdata/emu", "kernels"} {
		var names []string
		err := filepath.WalkDir(filepath.Join(root, sub), func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				names = append(names, p)
			}
			return err
		})
		if err != nil {
			return "", err
		}
		sort.Strings(names)
		for _, p := range names {
			b, err := os.ReadFile(p)
			if err != nil {
				return "", err
			}
			rel, _ := filepath.Rel(root, p)
			fmt.Fprintf(h, "%s\x00%d\x00%s", rel, len(b), b)
			if sub == "kernels" && strings.HasSuffix(p, ".cu") {
				kernels = append(kernels, p)
			}
		}
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
	// Object files carry the process id: two test binaries (compute/cuda
	// and compute/device run in parallel) may build at once; the library
	// is renamed into place whole.
	tag := fmt.Sprintf(".%d", os.Getpid())
	flags := []string{"-std=c++17", "-O2", "-g", "-fPIC", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"}
	var objs []string
	compile := func(name, src string) error {
		obj := filepath.Join(dir, name+tag+".o")
		cmd := exec.Command(cxx, append(flags, "-c", "-x", "c++", "-", "-o", obj)...)
		cmd.Stdin = strings.NewReader(src)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("g++ %s: %v\n%s", name, err, out)
		}
		objs = append(objs, obj)
		return nil
	}
	defer func() {
		for _, o := range objs {
			os.Remove(o)
		}
	}()
	emuDir := filepath.Join(root, "testdata", "emu")
	srcs, err := filepath.Glob(filepath.Join(emuDir, "*.cpp"))
	if err != nil {
		return "", err
	}
	sort.Strings(srcs)
	for _, src := range srcs {
		name := strings.TrimSuffix(filepath.Base(src), ".cpp")
		if err := compile(name, fmt.Sprintf("#include %q\n#include %q\n", filepath.Join(emuDir, "emu.h"), src)); err != nil {
			return "", err
		}
	}
	for _, k := range kernels {
		src := fmt.Sprintf("#include %q\n#include %q\n#include %q\n", filepath.Join(emuDir, "emu.h"),
			filepath.Join(root, "kernels", "prelude.cuh"), k)
		if err := compile(strings.TrimSuffix(filepath.Base(k), ".cu"), src); err != nil {
			return "", err
		}
	}
	tmp := lib + tag + ".tmp"
	out, err := exec.Command(cxx, append([]string{"-shared", "-o", tmp}, objs...)...).CombinedOutput()
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("linking the emulator: %v\n%s", err, out)
	}
	return lib, os.Rename(tmp, lib)
}
