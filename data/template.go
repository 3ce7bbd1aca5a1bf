package data

import "fmt"

// compileTemplate compiles a Jinja chat template into a Renderer.
func compileTemplate(src, bos, eos string) (Renderer, error) {
	return nil, fmt.Errorf("chat templates need distill/data/chattmpl, which has not landed yet")
}
