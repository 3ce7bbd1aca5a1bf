package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// The kernel cache keeps NVRTC's cubins on disk, so that a daemon restart
// does not recompile every kernel (seconds each). One file per (source,
// arch, NVRTC version, options):
//
//	<dir>/<key>.cubin      key = hex sha256 of the four, see cacheKey
//
// A file is the magic "DSTLCUBN", the sha256 of the payload (32 bytes),
// then the payload (the cubin). A file whose checksum does not match is
// treated as absent and rewritten: a torn or corrupted file costs one
// compilation, never a bad module. Files are written to a temporary name
// and renamed into place, so readers never see a partial file.
type kernelCache struct {
	dir string // "" disables the cache
}

const cacheMagic = "DSTLCUBN"

// defaultCacheDir is $DISTILL_KERNEL_CACHE, else <user cache dir>/distill/
// cuda-kernels; "" (no cache) when neither can be found. DISTILL_KERNEL_CACHE
// set to "off" disables the cache.
func defaultCacheDir() string {
	if d := os.Getenv("DISTILL_KERNEL_CACHE"); d != "" {
		if d == "off" {
			return ""
		}
		return d
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return ""
	}
	return filepath.Join(d, "distill", "cuda-kernels")
}

// cacheKey names the cubin of src compiled for arch by NVRTC nvrtcVersion
// with opts. Any change to any of them is a different key.
func cacheKey(src, arch, nvrtcVersion string, opts []string) string {
	h := sha256.New()
	for _, s := range []string{"distill-cubin-v1", src, arch, nvrtcVersion, strings.Join(opts, "\x01")} {
		fmt.Fprintf(h, "%d:%s\x00", len(s), s)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (c *kernelCache) path(key string) string { return filepath.Join(c.dir, key+".cubin") }

// get returns the cached payload of key, or ok = false when it is absent or
// fails its checksum.
func (c *kernelCache) get(key string) (payload []byte, ok bool) {
	if c.dir == "" {
		return nil, false
	}
	b, err := os.ReadFile(c.path(key))
	if err != nil || len(b) < len(cacheMagic)+sha256.Size || string(b[:len(cacheMagic)]) != cacheMagic {
		return nil, false
	}
	sum := b[len(cacheMagic) : len(cacheMagic)+sha256.Size]
	payload = b[len(cacheMagic)+sha256.Size:]
	if got := sha256.Sum256(payload); !bytes.Equal(got[:], sum) {
		return nil, false
	}
	return payload, true
}

// put stores payload under key atomically (temporary file, fsync, rename).
func (c *kernelCache) put(key string, payload []byte) error {
	if c.dir == "" {
		return nil
	}
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return fmt.Errorf("cuda: kernel cache %s: %w", c.dir, err)
	}
	f, err := os.CreateTemp(c.dir, key+".tmp*")
	if err != nil {
		return fmt.Errorf("cuda: kernel cache %s: %w", c.dir, err)
	}
	sum := sha256.Sum256(payload)
	_, err = f.Write(append(append([]byte(cacheMagic), sum[:]...), payload...))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), c.path(key))
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("cuda: kernel cache %s: %w", c.dir, err)
	}
	return nil
}

// compiler is what the cache needs from NVRTC (an interface so that the
// cache logic is tested without it).
type compiler interface {
	Version() string
	compile(name, src, arch string) (cubin []byte, log string, err error)
}

// cubin returns the cubin of kernel file f for arch: from the cache when it
// is there and intact, else compiled and stored. fromCache says which. A
// cache that cannot be written costs speed, not correctness: the error is
// returned in cacheErr for the caller to log, and the cubin is still good.
func (c *kernelCache) cubin(nv compiler, name, src, arch string) (cubin []byte, fromCache bool, cacheErr, err error) {
	key := cacheKey(src, arch, nv.Version(), compileOptions(arch))
	if b, ok := c.get(key); ok {
		return b, true, nil, nil
	}
	cubin, _, err = nv.compile(name, src, arch)
	if err != nil {
		return nil, false, nil, err
	}
	if perr := c.put(key, cubin); perr != nil {
		cacheErr = perr
	}
	return cubin, false, cacheErr, nil
}

// fileCubin is cubins' result for one kernel file: cubin's values and the
// time it took.
type fileCubin struct {
	cubin         []byte
	fromCache     bool
	cacheErr, err error
	took          time.Duration
}

// cubins is cubin for each of files, in their order, at most par at a
// time. NVRTC compiles separate programs on separate threads (its rule:
// no two threads on one nvrtcProgram), and a cold cache compiles every
// file at Open: one file at a time, TestKernelsCompile took 57 s for
// three archs on the H200's host (NVRTC 13, 2026-11-28).
func (c *kernelCache) cubins(nv compiler, files []kernelFile, arch string, par int) []fileCubin {
	out := make([]fileCubin, len(files))
	slots := make(chan struct{}, max(par, 1))
	var wg sync.WaitGroup
	for i, f := range files {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			t0 := time.Now()
			r := &out[i]
			r.cubin, r.fromCache, r.cacheErr, r.err = c.cubin(nv, string(f), f.source(), arch)
			r.took = time.Since(t0)
		}()
	}
	wg.Wait()
	return out
}
