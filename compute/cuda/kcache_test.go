package cuda

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeCompiler stands in for NVRTC: it counts compilations.
type fakeCompiler struct {
	version string
	calls   int
}

func (f *fakeCompiler) Version() string { return f.version }
func (f *fakeCompiler) compile(name, src, arch string) ([]byte, string, error) {
	f.calls++
	return []byte("cubin:" + arch + ":" + src), "", nil
}

func TestCacheKey(t *testing.T) {
	base := cacheKey("src", "sm_90a", "12.4", compileOptions("sm_90a"))
	if base != cacheKey("src", "sm_90a", "12.4", compileOptions("sm_90a")) {
		t.Fatal("cacheKey is not deterministic")
	}
	for name, k := range map[string]string{
		"source":  cacheKey("src ", "sm_90a", "12.4", compileOptions("sm_90a")),
		"arch":    cacheKey("src", "sm_80", "12.4", compileOptions("sm_90a")),
		"version": cacheKey("src", "sm_90a", "12.5", compileOptions("sm_90a")),
		"options": cacheKey("src", "sm_90a", "12.4", append(compileOptions("sm_90a"), "-G")),
		// Field boundaries are part of the key: no two splits collide.
		"split": cacheKey("srcs", "m_90a", "12.4", compileOptions("sm_90a")),
	} {
		if k == base {
			t.Errorf("changing the %s does not change the key", name)
		}
	}
}

func TestKernelCache(t *testing.T) {
	dir := t.TempDir()
	c := &kernelCache{dir: dir}
	nv := &fakeCompiler{version: "12.4"}
	get := func(src, arch string) (string, bool) {
		t.Helper()
		b, cached, cerr, err := c.cubin(nv, "f.cu", src, arch)
		if err != nil || cerr != nil {
			t.Fatalf("cubin: %v %v", err, cerr)
		}
		return string(b), cached
	}
	if b, cached := get("A", "sm_90a"); cached || b != "cubin:sm_90a:A" || nv.calls != 1 {
		t.Fatalf("first: %q cached=%v calls=%d", b, cached, nv.calls)
	}
	if b, cached := get("A", "sm_90a"); !cached || b != "cubin:sm_90a:A" || nv.calls != 1 {
		t.Fatalf("second: %q cached=%v calls=%d; want a cache hit", b, cached, nv.calls)
	}
	if _, cached := get("A", "sm_80"); cached || nv.calls != 2 {
		t.Fatal("another arch must compile")
	}
	nv.version = "12.5"
	if _, cached := get("A", "sm_90a"); cached || nv.calls != 3 {
		t.Fatal("another NVRTC version must compile")
	}
	// No temporary files are left behind.
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".cubin") {
			t.Errorf("left behind %s", e.Name())
		}
	}
	// A corrupted or truncated file is recompiled and rewritten.
	key := cacheKey("A", "sm_90a", "12.5", compileOptions("sm_90a"))
	p := filepath.Join(dir, key+".cubin")
	b, _ := os.ReadFile(p)
	b[len(b)-1] ^= 1
	os.WriteFile(p, b, 0o644)
	if got, cached := get("A", "sm_90a"); cached || got != "cubin:sm_90a:A" || nv.calls != 4 {
		t.Fatalf("corrupted entry: %q cached=%v calls=%d; want a recompilation", got, cached, nv.calls)
	}
	if _, cached := get("A", "sm_90a"); !cached {
		t.Fatal("the recompiled entry was not rewritten")
	}
	os.WriteFile(p, b[:10], 0o644)
	if _, cached := get("A", "sm_90a"); cached {
		t.Fatal("a truncated entry was used")
	}
}

// TestKernelCacheUnwritable: a cache that cannot be written costs a
// compilation each time, not a failure.
func TestKernelCacheUnwritable(t *testing.T) {
	file := filepath.Join(t.TempDir(), "not-a-dir")
	os.WriteFile(file, nil, 0o644)
	c := &kernelCache{dir: filepath.Join(file, "sub")}
	nv := &fakeCompiler{version: "11.8"}
	b, cached, cerr, err := c.cubin(nv, "f.cu", "A", "sm_80")
	if err != nil || cached || string(b) != "cubin:sm_80:A" {
		t.Fatalf("cubin: %q %v %v", b, cached, err)
	}
	if cerr == nil || !strings.Contains(cerr.Error(), "kernel cache") {
		t.Fatalf("want a cache error naming the kernel cache, got %v", cerr)
	}
	off := &kernelCache{}
	off.cubin(nv, "f.cu", "A", "sm_80")
	off.cubin(nv, "f.cu", "A", "sm_80")
	if nv.calls != 3 {
		t.Fatalf("a disabled cache must compile every time: %d calls", nv.calls)
	}
}

func TestDefaultCacheDir(t *testing.T) {
	t.Setenv("DISTILL_KERNEL_CACHE", "/x/y")
	if d := defaultCacheDir(); d != "/x/y" {
		t.Fatalf("DISTILL_KERNEL_CACHE=/x/y: %s", d)
	}
	t.Setenv("DISTILL_KERNEL_CACHE", "off")
	if d := defaultCacheDir(); d != "" {
		t.Fatalf("DISTILL_KERNEL_CACHE=off: %q", d)
	}
	t.Setenv("DISTILL_KERNEL_CACHE", "")
	t.Setenv("XDG_CACHE_HOME", "/c")
	if d := defaultCacheDir(); d != "/c/distill/cuda-kernels" {
		t.Fatalf("default: %s", d)
	}
}
