package cuda

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
)

// requireNVRTC returns NVRTC, or skips the test when it is not installed.
// CI sets DISTILL_REQUIRE_NVRTC=1 (scripts/test.sh), and there a missing
// NVRTC fails the test instead: the proof that the kernels compile must
// not silently vanish.
func requireNVRTC(t testing.TB) *nvrtc {
	t.Helper()
	n, err := loadNVRTC()
	if err != nil {
		if os.Getenv("DISTILL_REQUIRE_NVRTC") == "1" {
			t.Fatalf("DISTILL_REQUIRE_NVRTC=1 but %v (scripts/setup.d/nvrtc.sh installs it)", err)
		}
		t.Skipf("NVRTC not installed, kernels not compiled: %v (scripts/setup.d/nvrtc.sh installs it; DISTILL_REQUIRE_NVRTC=1 makes this a failure)", err)
	}
	return n
}

// TestKernelsCompile compiles every embedded kernel file to a cubin for
// sm_80 (Ampere) and sm_90 (Hopper) with the installed NVRTC, and fails on
// any error or warning. It needs no GPU. With NVRTC 12 or newer it also
// compiles for sm_90a, the arch the backend picks on Hopper. The files
// compiled in parallel, as Open compiles them, give whole cubins too.
//
// The same compiles carry ptxas's report (--ptxas-options=-v): for
// Hopper, every kernel's registers and spills are logged, for a GPU
// run's record, and the grouped MoE GEMMs are held to 128 registers
// without spills: two blocks of 256 threads an SM (their 110 KB of shared
// memory fits twice in Hopper's 228 KB). At 130 and 134 registers (NVRTC
// 11.8, sm_90) k_moe_gemm and k_moe_gemm_glu ran one block an SM, 8
// warps to hide the tensor cores' latency: 165 and 213 TFLOP/s in the
// Qwen3-30B-A3B forward on the H200 (2026-11-28).
func TestKernelsCompile(t *testing.T) {
	n := requireNVRTC(t)
	t.Logf("NVRTC %s (%s)", n.Version(), n.lib.path)
	archs := []string{"sm_80", "sm_90"}
	if n.supportsArch("sm_90a") {
		archs = append(archs, "sm_90a")
	}
	files := kernelFiles()
	if len(files) < 5 {
		t.Fatalf("found %d embedded kernel files, want at least 5", len(files))
	}
	for _, f := range files {
		for _, arch := range archs {
			cubin, log, err := n.compileWith(string(f), f.source(), arch, "--ptxas-options=-v")
			if err != nil {
				t.Errorf("%s for %s: %v", f, arch, err)
				continue
			}
			if w := withoutPtxasReport(log); w != "" {
				t.Errorf("%s for %s: NVRTC warned (warnings fail this test):\n%s", f, arch, w)
			}
			if !strings.HasPrefix(string(cubin), "\x7fELF") {
				t.Errorf("%s for %s: the cubin is not an ELF image", f, arch)
			}
			for _, k := range f.kernels() {
				if !strings.Contains(string(cubin), k) {
					t.Errorf("%s for %s: kernel %s is missing from the cubin (not extern \"C\"?)", f, arch, k)
				}
			}
			if arch != "sm_80" {
				checkResources(t, f, arch, log)
			}
		}
	}
	// Open compiles the files in parallel (kernelCache.cubins): each a
	// cubin with all its kernels. Not the same bits as one at a time:
	// NVRTC 11.8 is not deterministic even then (losshead.cu for sm_80
	// gave three different cubins in four compiles in one process,
	// 2026-11-28), so a GPU run of the suite, whose every test loads
	// kernels compiled this way, is the check of what they compute.
	par := (&kernelCache{}).cubins(n, files, "sm_80", len(files))
	for i, f := range files {
		r := par[i]
		if r.err != nil || r.fromCache || !strings.HasPrefix(string(r.cubin), "\x7fELF") {
			t.Fatalf("%s compiled in parallel: err %v, from the cache %v, %d bytes", f, r.err, r.fromCache, len(r.cubin))
		}
		for _, k := range f.kernels() {
			if !strings.Contains(string(r.cubin), k) {
				t.Errorf("%s compiled in parallel: kernel %s is missing from the cubin", f, k)
			}
		}
	}
}

// kernelResources is what ptxas reports of one kernel (--ptxas-options=-v).
type kernelResources struct {
	regs, stack, spillSt, spillLd int
}

// ptxasResources parses ptxas's -v report in an NVRTC log: per kernel,
// its registers, stack frame and spill bytes.
func ptxasResources(log string) map[string]kernelResources {
	out := map[string]kernelResources{}
	var cur string
	for _, line := range strings.Split(log, "\n") {
		var r kernelResources
		switch {
		case strings.Contains(line, "Compiling entry function '"):
			f := strings.Split(line, "'")
			if len(f) >= 2 {
				cur = f[1]
				out[cur] = kernelResources{}
			}
		case cur == "":
		case strings.Contains(line, "bytes stack frame"):
			r = out[cur]
			s := line[strings.Index(line, ".")+1:]
			fmt.Sscanf(strings.TrimSpace(s), "%d bytes stack frame, %d bytes spill stores, %d bytes spill loads", &r.stack, &r.spillSt, &r.spillLd)
			out[cur] = r
		case strings.Contains(line, "Used "):
			r = out[cur]
			fmt.Sscanf(line[strings.Index(line, "Used "):], "Used %d registers", &r.regs)
			out[cur] = r
		}
	}
	return out
}

// withoutPtxasReport is an NVRTC log without ptxas's -v report (its
// "ptxas info" lines and their "ptxas   ." continuations): what is left
// is warnings, ptxas's own included.
func withoutPtxasReport(log string) string {
	var keep []string
	for _, line := range strings.Split(log, "\n") {
		rest, ptxas := strings.CutPrefix(line, "ptxas")
		if ptxas && (strings.HasPrefix(rest, " info") || strings.HasPrefix(strings.TrimSpace(rest), ".")) {
			continue
		}
		keep = append(keep, line)
	}
	return strings.TrimSpace(strings.Join(keep, "\n"))
}

// checkResources logs the registers and spills ptxas reported (log) for
// each kernel of f compiled for arch, and holds moe.cu's grouped GEMMs to
// two blocks an SM (TestKernelsCompile).
func checkResources(t *testing.T, f kernelFile, arch, log string) {
	t.Helper()
	res := ptxasResources(log)
	if len(res) < len(f.kernels()) {
		t.Fatalf("%s for %s: ptxas reported %d kernels, the file has %d:\n%s", f, arch, len(res), len(f.kernels()), log)
	}
	names := make([]string, 0, len(res))
	for k := range res {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		r := res[k]
		t.Logf("%s %s: %d registers, %d bytes stack, %d/%d bytes spilled/reloaded", arch, k, r.regs, r.stack, r.spillSt, r.spillLd)
	}
	if f != "moe.cu" {
		return
	}
	for _, k := range []string{"k_moe_gemm", "k_moe_gemm_glu", "k_moe_gemm_nn", "k_moe_gemm_nn_acc", "k_moe_wgrad_gemm"} {
		r, ok := res[k]
		if !ok {
			t.Fatalf("%s for %s: no report of %s", f, arch, k)
		}
		if r.regs == 0 || r.regs > 128 || r.spillSt > 0 || r.spillLd > 0 {
			t.Errorf("%s for %s: %d registers, %d/%d bytes spilled: want at most 128 and no spills (two blocks an SM)", k, arch, r.regs, r.spillSt, r.spillLd)
		}
	}
}
