package cuda

import (
	"embed"
	"fmt"
	"path"
	"sort"
	"strings"
)

// The kernels are plain CUDA C++ files embedded in the binary; NVRTC
// compiles them on the machine that runs them, for its GPU.
//
//go:embed kernels/*.cu kernels/*.cuh
var kernelFS embed.FS

// kernelFile is one embedded .cu file, compiled as one module.
type kernelFile string

// kernelFiles lists the embedded .cu files, sorted.
func kernelFiles() []kernelFile {
	ents, err := kernelFS.ReadDir("kernels")
	if err != nil {
		panic(err) // embedded: cannot fail
	}
	var out []kernelFile
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".cu") {
			out = append(out, kernelFile(e.Name()))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// source is what NVRTC compiles for f: the prelude, then the file, with
// #line directives so that diagnostics name the right file and line.
func (f kernelFile) source() string {
	pre, err := kernelFS.ReadFile("kernels/prelude.cuh")
	if err != nil {
		panic(err)
	}
	body, err := kernelFS.ReadFile(path.Join("kernels", string(f)))
	if err != nil {
		panic(fmt.Sprintf("cuda: no embedded kernel file %s", f))
	}
	return fmt.Sprintf("#line 1 \"prelude.cuh\"\n%s\n#line 1 \"%s\"\n%s", pre, f, body)
}

// kernels returns the names of the kernels f defines (its DK_KERNEL
// functions), in file order.
func (f kernelFile) kernels() []string {
	body, _ := kernelFS.ReadFile(path.Join("kernels", string(f)))
	var out []string
	for _, line := range strings.Split(string(body), "\n") {
		if rest, ok := strings.CutPrefix(line, "DK_REGISTER("); ok {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(rest), ")"))
		}
	}
	return out
}
