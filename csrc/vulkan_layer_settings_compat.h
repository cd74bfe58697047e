// Declarations of VK_EXT_layer_settings for Vulkan headers that predate it (Debian 12 ships
// Vulkan-Headers 1.3.239). ggml-vulkan.cpp at llama.cpp e3a74b299 always builds a
// vk::LayerSettingsCreateInfoEXT for its instance (the validation layer it configures is
// only requested with GGML_VK_VALIDATE), so it does not compile against such headers.
// CMakeLists.txt force-includes this header into that one file, and only when the
// installed vulkan_core.h lacks the extension; with newer headers it is never seen.
//
// The layouts follow the Vulkan specification of VkLayerSettingEXT and
// VkLayerSettingsCreateInfoEXT; nothing here includes vulkan.hpp, which the file being
// compiled includes after this header, extending namespace vk.
#pragma once

#include <cstdint>
#include <vector>

namespace vk {

enum class LayerSettingTypeEXT : int32_t {
    eBool32 = 0,
    eInt32 = 1,
    eInt64 = 2,
    eUint32 = 3,
    eUint64 = 4,
    eFloat32 = 5,
    eFloat64 = 6,
    eString = 7,
};

struct LayerSettingEXT {
    const char * pLayerName;
    const char * pSettingName;
    LayerSettingTypeEXT type;
    uint32_t valueCount;
    const void * pValues;
};

// chained into VkInstanceCreateInfo::pNext; a loader or driver that does not know the
// structure type skips it, as the specification requires of extending structures
struct LayerSettingsCreateInfoEXT {
    int32_t sType = 1000496000;  // VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT
    const void * pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT * pSettings = nullptr;

    explicit LayerSettingsCreateInfoEXT(const std::vector<LayerSettingEXT> & settings)
        : settingCount(static_cast<uint32_t>(settings.size())), pSettings(settings.data()) {}
};

}  // namespace vk
