package dist

import (
	"fmt"
	"strconv"

	"gopkg.in/yaml.v3"
)

// FlattenConfig turns a config struct (or any value YAML can encode) into
// the key/value pairs Join compares across ranks: "optim.lr" -> "0.0003",
// a list's items as "data.cache[0]", an empty map or list as "{}" or "[]".
func FlattenConfig(v any) (map[string]string, error) {
	var n yaml.Node
	if err := n.Encode(v); err != nil {
		return nil, fmt.Errorf("dist: flatten config: %w", err)
	}
	out := map[string]string{}
	flattenNode(&n, "", out)
	return out, nil
}

func flattenNode(n *yaml.Node, prefix string, out map[string]string) {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			flattenNode(c, prefix, out)
		}
	case yaml.MappingNode:
		if len(n.Content) == 0 {
			out[prefix] = "{}"
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i].Value
			if prefix != "" {
				k = prefix + "." + k
			}
			flattenNode(n.Content[i+1], k, out)
		}
	case yaml.SequenceNode:
		if len(n.Content) == 0 {
			out[prefix] = "[]"
		}
		for i, c := range n.Content {
			flattenNode(c, prefix+"["+strconv.Itoa(i)+"]", out)
		}
	case yaml.AliasNode:
		flattenNode(n.Alias, prefix, out)
	default:
		out[prefix] = n.Value
	}
}
